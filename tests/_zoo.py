"""The model zoo: small linen and nnx models with their loss functions, batches and the layers
the scanner must find (shared by tests/suites/test_zoo.py and benchmarks/zoo.py).

Each builder returns a `Zoo`: `loss_fn(params, batch)`, `params`, `batch` and `expected`, the
`(kind, approx, param_paths)` of every layer a `kfac_jax.Registration` must find, in order.
Non-parameter state (BatchNorm statistics) stays outside `params`: linen's `batch_stats`
collection is passed through the batch and updated with `mutable=`, nnx's `BatchStat` variables
are split off by `nnx.split` and merged back inside `loss_fn`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import kfac_jax

N = 4  # batch size
CLASSES = 5


@dataclasses.dataclass
class Zoo:
  """`has_aux`: `loss_fn` returns `(loss, new_state)` and takes the state as `batch["state"]`
  (the README recipe for BatchNorm statistics). `check(specs)`: further model-specific
  assertions on the registered layers. `damping`: λ for the structure test's ten unclipped
  steps (see `timesformer_linen`)."""

  loss_fn: Callable
  params: Any
  batch: Any
  expected: list[tuple[str, str, tuple[str, ...]]]
  has_aux: bool = False
  check: Callable | None = None
  damping: float = 1e-2


def train_step(
  z: Zoo, tx, registration: kfac_jax.Registration | None = None, *, with_grads: bool = False
):
  """The jitted K-FAC training step of a zoo model: `step(params, state, batch, rng)` →
  `(params, state, batch, loss)`, and the gradient at `params` last with `with_grads`. With
  `z.has_aux`, the model state returned as the aux is fed back as `batch["state"]`. With
  `registration` (of `z`), its layers are used (no new scan); without, one of `z` with the
  default settings."""
  if registration is None:
    registration = kfac_jax.Registration(
      z.loss_fn, z.params, z.batch, has_aux=z.has_aux, warn=False
    )
  vg = kfac_jax.value_and_grad(registration=registration)

  @jax.jit
  def step(params, state, batch, rng):
    out, grads, stats = vg(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    loss, batch = (out[0], dict(batch, state=out[1])) if z.has_aux else (out, batch)
    out = optax.apply_updates(params, updates), state, batch, loss
    return out + (grads,) if with_grads else out

  return step


def _key(seed):
  """An "rbg" key: XLA's RngBitGenerator compiles in a fraction of threefry's time (about 5x on
  CPU), which is most of a small model's init and data compile."""
  return jax.random.key(seed, impl="rbg")


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
  variables = jax.jit(module.init)(_key(1), batch["x"])  # One program, not one per initialiser.
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


def _nnx_build(cls, *args):
  """`cls(*args, rngs)` from an "rbg" key: its eager initialisers compile faster than threefry's
  (and faster than the whole build under `nnx.jit`, whose programs no other model shares)."""
  return cls(*args, nnx.Rngs(_key(0)))


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
  batch = _images(_key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenMLP(), batch)
    return Zoo(f, p, b, [_dense("Dense_0"), _dense("Dense_1")])
  f, p, b = _nnx(_nnx_build(NnxMLP), batch)
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
  batch = _images(_key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenCNN(), batch)
    return Zoo(f, p, b, [_conv("Conv_0"), _conv("Conv_1"), _dense("Dense_0")])
  f, p, b = _nnx(_nnx_build(NnxCNN), batch)
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
  batch = _images(_key(0))
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
  model = _nnx_build(NnxResNet)
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
  k1, k2 = jax.random.split(_key(0))
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
  f, p, b = _nnx(_nnx_build(NnxLM), batch)
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
  batch = _images(_key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenSeparable(), batch)
    return Zoo(
      f, p, b, [_conv("Conv_0"), _conv("Conv_1", "diagonal"), _conv("Conv_2"), _dense("Dense_0")]
    )
  f, p, b = _nnx(_nnx_build(NnxSeparable), batch)
  return Zoo(
    f, p, b, [_conv("depthwise", "diagonal"), _dense("head"), _conv("pointwise"), _conv("stem")]
  )


# -- U-Net: per-pixel classes, a transposed convolution, a skip connection -----------------------


class LinenUNet(nn.Module):
  """Encoder conv + GroupNorm, a strided conv down, `nn.ConvTranspose` back up (stride 2), the
  skip connection concatenated on channels, a 1x1 conv to per-pixel logits `[N, H, W, C]`."""

  @nn.compact
  def __call__(self, x):
    e = nn.relu(nn.GroupNorm(num_groups=2, name="gn")(nn.Conv(4, (3, 3), name="enc")(x)))
    d = nn.relu(nn.Conv(8, (3, 3), strides=2, name="down")(e))
    u = nn.relu(nn.ConvTranspose(4, (2, 2), strides=(2, 2), name="up")(d))
    return nn.Conv(CLASSES, (1, 1), name="out")(jnp.concatenate([e, u], axis=-1))


class NnxUNet(nnx.Module):
  def __init__(self, rngs):
    self.enc = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.down = nnx.Conv(4, 8, (3, 3), strides=2, rngs=rngs)
    self.up = nnx.ConvTranspose(8, 4, (2, 2), strides=(2, 2), rngs=rngs)
    self.out = nnx.Conv(8, CLASSES, (1, 1), rngs=rngs)

  def __call__(self, x):
    e = nnx.relu(self.gn(self.enc(x)))
    u = nnx.relu(self.up(nnx.relu(self.down(e))))
    return self.out(jnp.concatenate([e, u], axis=-1))


def unet(flavour: str) -> Zoo:
  """Segmentation: the labels are per pixel, `[N, H, W]`, the loss their mean cross-entropy."""
  batch = _images(_key(0))
  batch["y"] = jax.random.randint(_key(3), (N, 8, 8), 0, CLASSES)
  layers = ["down", "enc", "gn", "out", "up"]
  make = LinenUNet() if flavour == "linen" else _nnx_build(NnxUNet)
  f, p, b = _linen(make, batch) if flavour == "linen" else _nnx(make, batch)
  return Zoo(f, p, b, [_norm(n) if n == "gn" else _conv(n) for n in layers])


MODELS = {
  "mlp": mlp,
  "cnn": cnn,
  "resnet": resnet,
  "transformer": transformer,
  "separable": separable,
  "unet": unet,
}


# ==============================================================================================
# Structure zoo: Haiku and equinox models, a Gemma-style RMSNorm, a
# ViT-ish model with a learned positional table, a Flax OptimizedLSTMCell, a 32k-vocabulary head.
# Builders take no flavour; tests/suites/test_zoo.py runs them through `STRUCTURE_MODELS`.
# ================================================================================================


def _hk_zoo(net, batch, expected):
  import haiku as hk  # pylint: disable=g-import-not-at-top (optional test extra)

  f = hk.without_apply_rng(hk.transform(net))
  params = jax.jit(f.init)(_key(1), batch["x"])

  def loss_fn(p, b):
    return _ce(f.apply(p, b["x"]), b["y"])

  return Zoo(loss_fn, params, batch, expected)


def haiku_mlp() -> Zoo:
  import haiku as hk  # pylint: disable=g-import-not-at-top

  def net(x):
    x = x.reshape(x.shape[0], -1)
    return hk.Linear(CLASSES)(jnp.tanh(hk.Linear(16)(x)))

  paths = lambda m: ("dense", "kron", (f"{m}/w", f"{m}/b"))  # noqa: E731
  return _hk_zoo(net, _images(_key(0)), [paths("linear"), paths("linear_1")])


def haiku_cnn() -> Zoo:
  import haiku as hk  # pylint: disable=g-import-not-at-top

  def net(x):  # hk.Conv2D adds its bias with `jnp.broadcast_to(b, out.shape)`.
    x = jax.nn.relu(hk.Conv2D(4, 3)(x))
    x = jax.nn.relu(hk.Conv2D(6, 3, stride=2, padding="VALID")(x))
    return hk.Linear(CLASSES)(x.reshape(x.shape[0], -1))

  return _hk_zoo(
    net,
    _images(_key(0)),
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

  @eqx.filter_jit
  def build(key):
    k = jax.random.split(key)
    return {
      "l1": eqx.nn.Linear(8 * 8 * 3, 16, key=k[0]),
      "l2": eqx.nn.Linear(16, CLASSES, key=k[1]),
    }

  model = build(_key(2))

  def apply(m, x):
    def one(x):  # One example: the equinox idiom, batched with vmap.
      return m["l2"](jnp.tanh(m["l1"](x.reshape(-1))))

    return jax.vmap(one)(x)

  paths = lambda m: ("dense", "kron", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  return _eqx_zoo(model, _images(_key(0)), apply, [paths("l1"), paths("l2")])


def equinox_cnn() -> Zoo:
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  @eqx.filter_jit
  def build(key):
    k = jax.random.split(key, 3)
    return {
      "c1": eqx.nn.Conv2d(3, 4, 3, padding=1, key=k[0]),
      "c2": eqx.nn.Conv2d(4, 6, 3, stride=2, key=k[1]),
      "head": eqx.nn.Linear(6 * 3 * 3, CLASSES, key=k[2]),
    }

  model = build(_key(3))

  def apply(m, x):
    def one(x):  # [H, W, C] -> equinox's channel-first layout.
      x = jax.nn.relu(m["c1"](x.transpose(2, 0, 1)))
      x = jax.nn.relu(m["c2"](x))
      return m["head"](x.reshape(-1))

    return jax.vmap(one)(x)

  return _eqx_zoo(
    model,
    _images(_key(0)),
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

  k1, k2 = jax.random.split(_key(4))
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

  f, p, b = _linen(ViT(), _images(_key(0)))
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

  k1, k2 = jax.random.split(_key(5))
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

  k1, k2 = jax.random.split(_key(7))
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

  k1, k2 = jax.random.split(_key(6))
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


# -- VAE, BatchNorm ResNets, mixture of experts, GRU --------------------------------------------


VAE_PIXELS, VAE_LATENT = 16, 3


class LinenVAE(nn.Module):
  """Encoder → (mean, log-variance) → z = mean + σ ε → decoder logits over binary pixels."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16, name="enc")(x))
    mean = nn.Dense(VAE_LATENT, name="mean")(h)
    logvar = nn.Dense(VAE_LATENT, name="logvar")(h)
    eps = jax.random.normal(self.make_rng("noise"), mean.shape)
    z = mean + jnp.exp(0.5 * logvar) * eps
    logits = nn.Dense(VAE_PIXELS, name="dec_out")(nn.relu(nn.Dense(16, name="dec")(z)))
    return logits, mean, logvar


def _neg_elbo(logits, mean, logvar, x):
  """The VAEs' loss: Bernoulli reconstruction (the one registered loss) + KL to N(0, I)."""
  kfac_jax.register_sigmoid_cross_entropy_loss(logits, x)
  recon = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
  kl = 0.5 * jnp.sum(jnp.exp(logvar) + mean**2 - 1.0 - logvar, axis=-1)
  return jnp.mean(recon + kl)


def vae() -> Zoo:
  """A VAE trained on the negative ELBO: per example, the pixels' summed sigmoid cross-entropy
  plus `KL(q(z|x) ‖ N(0, I))`, averaged over the batch.

  Only the reconstruction is a registered loss: `register_sigmoid_cross_entropy_loss(logits, x)`,
  the decoder's Bernoulli likelihood. With the noise ε fixed per step (it comes from the batch's
  key), z is a function of the parameters, so the curvature of that likelihood reaches the
  encoder (mean, logvar, enc) through z. The KL term is no likelihood of data: it has no
  predictive distribution to sample from, so it is not tagged; it enters the loss and the
  gradient, and its curvature (I on the mean, ½ e^logvar on logvar) is left to the damping,
  as for any unregistered regulariser.
  """
  kx, kn = jax.random.split(_key(8))
  x = (jax.random.uniform(kx, (N, VAE_PIXELS)) < 0.3).astype(jnp.float32)
  batch = {"x": x, "noise": kn}
  model = LinenVAE()
  params = jax.jit(model.init)({"params": _key(1), "noise": kn}, x)["params"]

  def loss_fn(p, b):
    logits, mean, logvar = model.apply({"params": p}, b["x"], rngs={"noise": b["noise"]})
    return _neg_elbo(logits, mean, logvar, b["x"])

  return Zoo(
    loss_fn,
    params,
    batch,
    [_dense(m) for m in ("dec", "dec_out", "enc", "logvar", "mean")],
  )


def haiku_resnet() -> Zoo:
  """Two residual stages (8 and 16 channels, the second strided with a projection shortcut),
  `hk.BatchNorm` in training mode under `hk.transform_with_state`: the state rides in
  `batch["state"]` and comes back as the aux."""
  import haiku as hk  # pylint: disable=g-import-not-at-top

  class Block(hk.Module):
    def __init__(self, channels, stride, name=None):
      super().__init__(name=name)
      self.channels, self.stride = channels, stride

    def __call__(self, x, is_training):
      bn = lambda name: hk.BatchNorm(True, True, 0.9, name=name)  # noqa: E731
      y = hk.Conv2D(self.channels, 3, stride=self.stride, with_bias=False, name="conv1")(x)
      y = jax.nn.relu(bn("bn1")(y, is_training))
      y = bn("bn2")(hk.Conv2D(self.channels, 3, with_bias=False, name="conv2")(y), is_training)
      if self.stride != 1 or x.shape[-1] != self.channels:
        x = hk.Conv2D(self.channels, 1, stride=self.stride, with_bias=False, name="proj")(x)
        x = bn("proj_bn")(x, is_training)
      return jax.nn.relu(x + y)

  def forward(x, is_training):
    x = hk.Conv2D(8, 3, with_bias=False, name="stem")(x)
    x = jax.nn.relu(hk.BatchNorm(True, True, 0.9, name="stem_bn")(x, is_training))
    x = Block(8, 1, name="stage1")(x, is_training)
    x = Block(16, 2, name="stage2")(x, is_training)
    return hk.Linear(CLASSES, name="head")(jnp.mean(x, axis=(1, 2)))

  net = hk.without_apply_rng(hk.transform_with_state(forward))
  batch = _images(_key(0))
  # Jitted: an eager init compiles each of its small ops on its own (seconds on a busy core).
  params, state = jax.jit(lambda k, x: net.init(k, x, True))(_key(1), batch["x"])

  def loss_fn(p, b):
    logits, new_state = net.apply(p, b["state"], b["x"], True)
    return _ce(logits, b["y"]), new_state

  conv = lambda m: ("conv", "kron", (f"{m}/w",))  # noqa: E731
  bn = lambda m: ("scale_and_shift", "full", (f"{m}/scale", f"{m}/offset"))  # noqa: E731
  return Zoo(
    loss_fn,
    params,
    dict(batch, state=state),
    [("dense", "kron", ("head/w", "head/b"))]
    + [bn("stage1/bn1"), bn("stage1/bn2"), conv("stage1/conv1"), conv("stage1/conv2")]
    + [bn("stage2/bn1"), bn("stage2/bn2"), conv("stage2/conv1"), conv("stage2/conv2")]
    + [conv("stage2/proj"), bn("stage2/proj_bn"), conv("stem"), bn("stem_bn")],
    has_aux=True,
  )


def equinox_resnet() -> Zoo:
  """The same ResNet in equinox: channel-first convolutions, `eqx.nn.BatchNorm` (batch
  statistics over the vmapped axis "batch") with its `eqx.nn.State` in `batch["state"]`. The
  BatchNorm weight `[C]` is viewed as `[C, 1, 1]` over `[N, C, H, W]`: a scale-and-shift layer
  over an inner axis."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class Block(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    proj: eqx.nn.Conv2d | None
    proj_bn: eqx.nn.BatchNorm | None

    def __init__(self, cin, cout, stride, key):
      k1, k2, k3 = jax.random.split(key, 3)
      conv = lambda i, o, k, s, key: eqx.nn.Conv2d(  # noqa: E731
        i, o, k, s, padding=k // 2, use_bias=False, key=key
      )
      self.conv1, self.conv2 = conv(cin, cout, 3, stride, k1), conv(cout, cout, 3, 1, k2)
      self.bn1 = eqx.nn.BatchNorm(cout, "batch", momentum=0.9, mode="batch")
      self.bn2 = eqx.nn.BatchNorm(cout, "batch", momentum=0.9, mode="batch")
      if stride != 1 or cin != cout:
        self.proj = conv(cin, cout, 1, stride, k3)
        self.proj_bn = eqx.nn.BatchNorm(cout, "batch", momentum=0.9, mode="batch")
      else:
        self.proj = self.proj_bn = None

    def __call__(self, x, state):
      y, state = self.bn1(self.conv1(x), state)
      y, state = self.bn2(self.conv2(jax.nn.relu(y)), state)
      if self.proj is not None:
        x, state = self.proj_bn(self.proj(x), state)
      return jax.nn.relu(x + y), state

  class ResNet(eqx.Module):
    stem: eqx.nn.Conv2d
    stem_bn: eqx.nn.BatchNorm
    stages: tuple[Block, Block]
    head: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 4)
      self.stem = eqx.nn.Conv2d(3, 8, 3, padding=1, use_bias=False, key=k[0])
      self.stem_bn = eqx.nn.BatchNorm(8, "batch", momentum=0.9, mode="batch")
      self.stages = (Block(8, 8, 1, k[1]), Block(8, 16, 2, k[2]))
      self.head = eqx.nn.Linear(16, CLASSES, key=k[3])

    def __call__(self, x, state):  # One example [H, W, C].
      x, state = self.stem_bn(self.stem(x.transpose(2, 0, 1)), state)
      x = jax.nn.relu(x)
      for stage in self.stages:
        x, state = stage(x, state)
      return self.head(jnp.mean(x, axis=(1, 2))), state

  model, state = eqx.filter_jit(eqx.nn.make_with_state(ResNet))(_key(9))
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(p, b):
    batched = jax.vmap(
      eqx.combine(p, static), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    logits, new_state = batched(b["x"], b["state"])
    return _ce(logits, b["y"]), new_state

  conv = lambda m: ("conv", "kron", (f"{m}/weight",))  # noqa: E731
  bn = lambda m: ("scale_and_shift", "full", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  stage = lambda i: [conv(f"{i}/conv1"), bn(f"{i}/bn1"), conv(f"{i}/conv2"), bn(f"{i}/bn2")]  # noqa: E731

  def check(specs):  # The BatchNorms scale the channel axis of [N, C, H, W].
    norms = [s.info for s in specs if s.kind == "scale_and_shift"]
    assert len(norms) == 6 and all(i.feature_axis == 1 for i in norms), norms

  return Zoo(
    loss_fn,
    params,
    dict(_images(_key(0)), state=state),
    [conv("stem"), bn("stem_bn")]
    + stage("stages/0")
    + stage("stages/1")
    + [
      conv("stages/1/proj"),
      bn("stages/1/proj_bn"),
      ("dense", "kron", ("head/weight", "head/bias")),
    ],
    has_aux=True,
    check=check,
  )


MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN = 4, 2, 12


class LinenMoE(nn.Module):
  """A top-k mixture-of-experts MLP over tokens `[T, D]`.

  The router (a dense layer) gives each token a softmax over experts; the top k, renormalised,
  are its gates. The experts are one expert-stacked kernel per projection, `[E, D, F]` and
  `[E, F, D]`; each expert sees the tokens routed to it (the others zeroed by the one-hot
  dispatch mask) and the gates combine their outputs. Returns the output and a Switch-style
  load-balancing term (fraction of tokens routed × mean router probability, per expert).
  """

  @nn.compact
  def __call__(self, x):
    e, d = MOE_EXPERTS, x.shape[-1]
    probs = jax.nn.softmax(nn.Dense(e, use_bias=False, name="router")(x))
    gate, idx = jax.lax.top_k(probs, MOE_TOP_K)  # [T, k]
    gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(idx, e) * gate[..., None], axis=1)  # [T, E]
    dispatch = jnp.sum(jax.nn.one_hot(idx, e), axis=1)  # [T, E], k ones per token
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    w_in = self.param("w_in", init, (e, d, MOE_HIDDEN))
    w_out = self.param("w_out", init, (e, MOE_HIDDEN, d))
    xe = jnp.einsum("te,td->etd", dispatch, x)
    ye = jnp.einsum("etf,efd->etd", nn.gelu(jnp.einsum("etd,edf->etf", xe, w_in)), w_out)
    balance = e * jnp.sum(jnp.mean(dispatch, axis=0) / MOE_TOP_K * jnp.mean(probs, axis=0))
    return jnp.einsum("te,etd->td", combine, ye), balance


def _moe_check(specs):
  stacks = {s.param_paths: s.stack_size for s in specs}
  assert stacks[("moe/w_in",)] == stacks[("moe/w_out",)] == MOE_EXPERTS, stacks


def _moe_zoo(loss_fn, params, batch) -> Zoo:
  """The MoE token classifier's registration, shared by its linen and nnx versions."""
  expected = [
    _dense("embed"),
    _dense("head"),
    ("dense", "kron", ("moe/router/kernel",)),
    ("dense", "kron", ("moe/w_in",)),
    ("dense", "kron", ("moe/w_out",)),
    _norm("norm"),
  ]
  return Zoo(loss_fn, params, batch, expected, check=_moe_check)


def moe() -> Zoo:
  """A token classifier with a residual top-2-of-4 MoE block.

  Every parameter is a structured layer: the router kernel is an ordinary dense layer (its
  block needs its input and the gradient at its output, which flows through the softmax and the
  selected gates; `top_k`'s choice of experts is piecewise constant), and each expert kernel is
  a dense layer of a stack of `MOE_EXPERTS` (the batched `einsum` over the expert axis), with
  one Kronecker block per expert. The load-balancing term is added to the loss but, like any
  regulariser that is no likelihood, not registered.
  """

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      n, s, d = x.shape
      h = nn.Dense(8, name="embed")(x)
      y, balance = LinenMoE(name="moe")(nn.LayerNorm(name="norm")(h).reshape(n * s, 8))
      h = h + y.reshape(n, s, 8)
      return nn.Dense(CLASSES, name="head")(jnp.mean(h, axis=1)), balance

  kx, ky = jax.random.split(_key(10))
  batch = {"x": jax.random.normal(kx, (N, 3, 6)), "y": jax.random.randint(ky, (N,), 0, CLASSES)}
  model = Model()
  params = jax.jit(model.init)(_key(1), batch["x"])["params"]

  def loss_fn(p, b):
    logits, balance = model.apply({"params": p}, b["x"])
    return _ce(logits, b["y"]) + 0.01 * balance

  return _moe_zoo(loss_fn, params, batch)


def equinox_gru() -> Zoo:
  """`eqx.nn.GRUCell` run over time by `lax.scan` (the cell closed over: shared layers with one
  use a step), vmapped over the batch, a linear head on the last state."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  steps, hidden = 5, 6

  class GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.cell = eqx.nn.GRUCell(4, hidden, key=k1)
      self.head = eqx.nn.Linear(hidden, CLASSES, key=k2)

    def __call__(self, xs):  # One sequence [T, 4].
      h, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), jnp.zeros(hidden), xs)
      return self.head(h)

  k1, k2 = jax.random.split(_key(11))
  batch = {"x": jax.random.normal(k1, (N, steps, 4)), "y": jax.random.randint(k2, (N,), 0, CLASSES)}

  def check(specs):
    uses = {s.param_paths[0]: s.num_uses for s in specs}
    assert uses == {
      "cell/weight_ih": steps,
      "cell/weight_hh": steps,
      "cell/bias_n": steps,
      "head/weight": 1,
    }, uses

  z = _eqx_zoo(
    eqx.filter_jit(GRU)(_key(12)),
    batch,
    lambda m, x: jax.vmap(m)(x),
    [
      ("dense", "kron_indep", ("cell/weight_ih", "cell/bias")),
      ("dense", "kron_indep", ("cell/weight_hh",)),
      ("scale_and_shift", "full", ("cell/bias_n",)),  # Added to the candidate gate's h-part.
      ("dense", "kron", ("head/weight", "head/bias")),
    ],
  )
  z.check = check
  return z


# -- locally connected layer (unshared convolution) -----------------------------------------------


class LinenLocallyConnected(nn.Module):
  """A DeepFace-style classifier: a shared convolution and pooling, then a locally connected
  layer (`nn.ConvLocal`: its own 3x3 filter bank at every location of the pooled map, for
  inputs whose regions differ, like aligned faces), then a linear head."""

  @nn.compact
  def __call__(self, x):
    x = nn.max_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), (2, 2))  # [N, 4, 4, 4]
    x = nn.relu(nn.ConvLocal(6, (3, 3))(x))  # SAME padding: [N, 4, 4, 6]
    return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


def locally_connected() -> Zoo:
  f, p, b = _linen(LinenLocallyConnected(), _images(_key(0)))
  local = ("grouped_dense", "kron", ("ConvLocal_0/kernel", "ConvLocal_0/bias"))
  return Zoo(f, p, b, [local, _conv("Conv_0"), _dense("Dense_0")])


def vmc_ferminet() -> Zoo:
  """A FermiNet-class wave function on Li (examples/vmc.py, small): dense layers over electrons
  `[B, n, d]` and electron pairs `[B, n, n, d]`, envelopes `[atoms, orbitals]`, determinants;
  nuclear positions in the batch without a walker axis; FermiNet's loss, a custom_jvp whose
  rule is the VMC gradient and holds the normal tag on log|psi| (no audit: the loss is not
  the tag's)."""
  from examples import vmc  # The example defines the model; the zoo checks what is found.

  system = vmc.SYSTEMS["Li"]
  net = vmc.Net(one=8, two=4, layers=2, determinants=2)
  params = vmc.init_params(_key(0), system, net)
  batch = {"r": vmc.init_walkers(_key(1), system, N), "atoms": jnp.asarray(system.atoms)}
  dense = lambda prefix: ("dense", "kron", (f"{prefix}/w", f"{prefix}/b"))  # noqa: E731
  envelope = [("scale_and_shift", "full", (f"{{}}/{n}",)) for n in ("pi", "sigma")]
  expected = [dense("layers/0/one"), dense("layers/0/two"), dense("layers/1/one")]
  for spin in ("down", "up"):
    expected.append(dense(f"orbitals/{spin}/dense"))
    expected += [(k, a, (paths[0].format(f"orbitals/{spin}"),)) for k, a, paths in envelope]
  return Zoo(vmc.make_loss(system), params, batch, expected)


def pinn_poisson() -> Zoo:
  """A physics-informed network (examples/pinn_poisson.py, smaller): the forward Laplacian,
  each layer one dense layer shared by the points' value, gradient and Laplacian; a residual
  tag on 16 interior points and a boundary tag on 8 points ("kron_terms": one Kronecker
  product per tag)."""
  from examples import pinn_poisson as pp

  sizes = (2, 8, 1)
  params = pp.init_params(0, sizes, jnp.float32)
  batch = pp.make_problem(0, n_interior=16, n_boundary=8, dtype=jnp.float32).batch
  expected = [("dense", "kron_terms", (f"{i}/w", f"{i}/b")) for i in range(2)]
  return Zoo(pp.loss_fn, params, batch, expected)


class LinenGroupedLocal(nn.Module):
  """Every grouped layout: a convolution in two feature groups, then a locally connected layer
  (one group per output location)."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.relu(nn.Conv(6, (3, 3), feature_group_count=2)(x))  # 2 groups of 2 -> 3 channels
    x = nn.max_pool(x, (2, 2), (2, 2))  # [N, 4, 4, 6]
    x = nn.relu(nn.ConvLocal(4, (3, 3))(x))  # 16 locations
    return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


def grouped_local() -> Zoo:
  f, p, b = _linen(LinenGroupedLocal(), _images(_key(0)))
  local = ("grouped_dense", "kron", ("ConvLocal_0/kernel", "ConvLocal_0/bias"))
  return Zoo(f, p, b, [local, _conv("Conv_0"), _conv("Conv_1"), _dense("Dense_0")])


def vmc_ferminet_anisotropic() -> Zoo:
  """The FermiNet-class wave function on LiH (two atoms) with FermiNet's anisotropic envelope,
  `einsum("bnai,ijak->bnajk", r - R, sigma)`, `sigma: [3, 3, atoms, orbitals]`: a dense layer
  per atom (a grouped dense layer, one Kronecker pair per atom)."""
  from examples import vmc

  system = vmc.SYSTEMS["LiH"]
  net = vmc.Net(one=8, two=4, layers=2, determinants=2, envelope="anisotropic")
  params = vmc.init_params(_key(0), system, net)
  batch = {"r": vmc.init_walkers(_key(1), system, N), "atoms": jnp.asarray(system.atoms)}
  dense = lambda prefix: ("dense", "kron", (f"{prefix}/w", f"{prefix}/b"))  # noqa: E731
  expected = [dense("layers/0/one"), dense("layers/0/two"), dense("layers/1/one")]
  for spin in ("down", "up"):
    expected.append(dense(f"orbitals/{spin}/dense"))
    expected.append(("scale_and_shift", "full", (f"orbitals/{spin}/pi",)))
    expected.append(("grouped_dense", "kron", (f"orbitals/{spin}/sigma",)))
  return Zoo(vmc.make_loss(system), params, batch, expected)


# -- FermiNet's loss: a custom_jvp energy returning (loss, aux), its tag in the JVP rule ---------


class VmcAux(NamedTuple):
  """The loss's auxiliary data, FermiNet's fields: the mean energy, its variance, the local
  energies and the clipped ones (per walker in the function; FermiNet's rule stores the clipped
  energies' mean there, a scalar)."""

  energy: jax.Array
  variance: jax.Array
  local_energy: jax.Array
  clipped_energy: jax.Array


def _clipped(e_l, scale: float):
  """`(centre, deviations)`: the local energies clipped to the median ± `scale` times their
  mean absolute deviation from it (a complex energy's parts each in its own window), centred
  at the clipped mean."""

  def window(x, centre):
    width = scale * jnp.mean(jnp.abs(x - centre))
    return jnp.clip(x, centre - width, centre + width)

  centre = jnp.median(e_l.real)
  clipped = window(e_l.real, centre)
  if jnp.iscomplexobj(e_l):
    clipped = clipped + 1j * window(e_l.imag, 0.0)
  mean = jnp.mean(clipped)
  return mean, clipped - mean


def vmc_total_energy(
  log_psi: Callable, local_energy: Callable, clip: float = 5.0, tag: bool = True
) -> Callable:
  """`total_energy(params, batch) -> (E, VmcAux)` in FermiNet's form: a `jax.custom_jvp` whose
  rule is the VMC gradient `2 Re E[(E_L - E) conj(∂ log ψ)]` from clipped local energies, and
  registers the curvature of |ψ|² as `register_normal_predictive_distribution(log|ψ|[:, None])`
  (the real part of a complex log ψ). As in FermiNet, the rule's primal outputs are not the
  function's: `aux.clipped_energy` is a scalar there, and a complex energy becomes its real
  part, which `jax.grad` accepts. Without `tag`, the rule registers nothing."""

  @jax.custom_jvp
  def total_energy(params, batch):
    e_l = local_energy(params, batch)
    loss = jnp.mean(e_l)
    diff = e_l - loss
    return loss, VmcAux(loss, jnp.mean(diff * jnp.conj(diff)).real, e_l, e_l)

  @total_energy.defjvp
  def total_energy_jvp(primals, tangents):
    params, batch = primals
    loss, aux = total_energy(params, batch)
    centre, diff = _clipped(aux.local_energy, clip)
    aux = aux._replace(clipped_energy=centre)
    psi, psi_dot = jax.jvp(lambda p: log_psi(p, batch), (params,), (tangents[0],))
    n = aux.local_energy.shape[0]
    if tag:
      kfac_jax.register_normal_predictive_distribution(psi.real[:, None])
    if jnp.iscomplexobj(psi):
      grad = 2.0 * jnp.real(jnp.dot(diff, jnp.conj(psi_dot))) / n
      return (loss.real, aux), (grad, aux)
    return (loss, aux), (2.0 * jnp.dot(psi_dot, diff) / n, aux)

  return total_energy


def _phase_log_psi(vmc, system):
  """A complex log ψ: FermiNet-class log|ψ| plus `log(u + i v)` from a small dense head on
  the walkers' coordinates."""

  def log_psi(params, batch):
    r = batch["r"]
    head = params["phase"]
    h = jnp.tanh(r.reshape(r.shape[0], -1) @ head["w1"] + head["b1"])
    uv = h @ head["w2"] + head["b2"]
    return vmc.log_psi(params, r, batch["atoms"], system.spins) + jnp.log(
      jax.lax.complex(uv[:, 0], uv[:, 1])
    )

  return log_psi


def _complex_local_energy(log_psi: Callable, system):
  """E_L = −½ (∇² log ψ + (∇ log ψ)²) + V of a complex log ψ, by forward-mode derivatives."""
  charges = jnp.asarray(system.charges)

  def local_energy(params, batch):
    from examples import vmc

    r, atoms = batch["r"], batch["atoms"]
    shape = r.shape[1:]

    def one(y):
      return log_psi(params, {"r": y.reshape((1,) + shape), "atoms": atoms})[0]

    def kinetic(x):
      grad = jax.jacfwd(one)
      g = grad(x)
      cols = jax.vmap(lambda e: jax.jvp(grad, (x,), (e,))[1])(jnp.eye(x.size, dtype=x.dtype))
      return -0.5 * (jnp.trace(cols) + g @ g)

    return jax.vmap(kinetic)(r.reshape(r.shape[0], -1)) + vmc.potential(r, atoms, charges)

  return local_energy


def vmc_ferminet_loss(complex_output: bool = False, tag: bool = True, walkers: int = N):
  """FermiNet's loss on Li with a small FermiNet-class network (examples/vmc.py): `(loss_fn,
  params, batch, log_psi)`, `loss_fn` = `vmc_total_energy` returning `(E, VmcAux)`; with
  `complex_output`, log ψ has a phase (`_phase_log_psi`); without `tag`, the rule registers
  nothing."""
  from examples import vmc

  system = vmc.SYSTEMS["Li"]
  params = vmc.init_params(_key(0), system, vmc.Net(one=8, two=4, layers=2, determinants=2))
  batch = {"r": vmc.init_walkers(_key(1), system, walkers), "atoms": jnp.asarray(system.atoms)}
  charges = jnp.asarray(system.charges)
  if complex_output:
    k1, k2 = jax.random.split(_key(2))
    params["phase"] = {
      "w1": jax.random.normal(k1, (9, 4)) / 3.0,
      "b1": jnp.zeros(4),
      "w2": jax.random.normal(k2, (4, 2)) / 2.0,
      "b2": jnp.asarray([1.0, 0.5]),
    }
    log_psi = _phase_log_psi(vmc, system)
    energy = _complex_local_energy(log_psi, system)
  else:

    def log_psi(params, batch):
      return vmc.log_psi(params, batch["r"], batch["atoms"], system.spins)

    def energy(params, batch):
      return vmc.local_energy(params, batch["r"], batch["atoms"], charges, system.spins)

  return vmc_total_energy(log_psi, energy, tag=tag), params, batch, log_psi


def _vmc_expected(extra=()):
  dense = lambda prefix: ("dense", "kron", (f"{prefix}/w", f"{prefix}/b"))  # noqa: E731
  expected = [dense("layers/0/one"), dense("layers/0/two"), dense("layers/1/one")]
  for spin in ("down", "up"):
    expected.append(dense(f"orbitals/{spin}/dense"))
    expected += [("scale_and_shift", "full", (f"orbitals/{spin}/{n}",)) for n in ("pi", "sigma")]
  return expected + list(extra)


def vmc_ferminet_aux() -> Zoo:
  """FermiNet's loss as FermiNet writes it (`vmc_total_energy`): a custom_jvp returning
  `(E, VmcAux)` with per-walker local energies, clipped around their median in the rule, whose
  aux differs from the function's (a scalar `clipped_energy`); the tag on log|ψ| in the rule.
  The aux is FermiNet's diagnostics, not model state: not trained here (`train_step` would feed
  it back as `batch["state"]`)."""
  loss_fn, params, batch, _ = vmc_ferminet_loss()
  return Zoo(loss_fn, params, batch, _vmc_expected(), has_aux=True)


def vmc_ferminet_complex() -> Zoo:
  """`vmc_ferminet_aux` with a complex log ψ (a phase head): the energy and its local values
  are complex in the function, real in the rule, and the tag is on Re log ψ = log|ψ|."""
  loss_fn, params, batch, _ = vmc_ferminet_loss(complex_output=True)
  phase = [("dense", "kron", ("phase/w1", "phase/b1")), ("dense", "kron", ("phase/w2", "phase/b2"))]
  return Zoo(loss_fn, params, batch, _vmc_expected(phase), has_aux=True)


STRUCTURE_MODELS = {
  "vmc_ferminet_aux": vmc_ferminet_aux,
  "vmc_ferminet_complex": vmc_ferminet_complex,
  "vmc_ferminet": vmc_ferminet,
  "vmc_ferminet_anisotropic": vmc_ferminet_anisotropic,
  "haiku_mlp": haiku_mlp,
  "haiku_cnn": haiku_cnn,
  "equinox_mlp": equinox_mlp,
  "equinox_cnn": equinox_cnn,
  "gemma_rmsnorm": gemma_rmsnorm,
  "vit_positional": vit_positional,
  "lstm": lstm,
  "lstm_rnn": lstm_rnn,
  "vocab_lm": vocab_lm,
  "vae": vae,
  "haiku_resnet": haiku_resnet,
  "equinox_resnet": equinox_resnet,
  "moe": moe,
  "equinox_gru": equinox_gru,
  "locally_connected": locally_connected,
  "pinn_poisson": pinn_poisson,
}


# ==============================================================================================
# Transformations: scan over stacked layers, remat, vmap-created layers.
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
  k1, k2 = jax.random.split(_key(0))
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
    f, p, b = _nnx(_nnx_build(NnxScannedLM), batch)
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
  batch = _images(_key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenStackedMLP(), batch)
  else:
    f, p, b = _nnx(_nnx_build(NnxStackedMLP), batch)
  expected = sorted(
    [_dense("head"), _dense("layers/dense"), _norm("layers/norm"), _dense("stem")],
    key=lambda e: e[2],
  )
  return Zoo(f, p, b, expected)


# The zoo models whose layers are stacked (`LayerSpec.stack_size == LM_LAYERS`).
STACKED_MODELS = {"scanned_lm": scanned_lm, "stacked_mlp": stacked_mlp}
MODELS.update(STACKED_MODELS)


# ==============================================================================================
# Haiku and equinox versions of the zoo's families (real model code keeps its structure): each
# written in its library's idiom, registered in `STRUCTURE_MODELS`.
# ==============================================================================================


def _lm_batch(seed):
  k1, k2 = jax.random.split(_key(seed))
  return {
    "x": jax.random.randint(k1, (N, SEQ), 0, VOCAB),
    "y": jax.random.randint(k2, (N, SEQ), 0, VOCAB),
  }


def _stacks(size, *prefixes):
  """A `check`: the layers under `prefixes` are stacks of `size`, the others are not stacked."""

  def check(specs):
    got = {s.param_paths[0]: s.stack_size for s in specs}
    want = {p: size if any(p.startswith(q) for q in prefixes) else 0 for p in got}
    assert got == want, got

  return check


def haiku_lm() -> Zoo:
  """Decoder LM in Haiku: RMSNorm, GQA attention with RoPE over `hk.Linear` projections, a
  SwiGLU MLP; the blocks stacked by `hk.layer_stack` (a scan over params with a leading layer
  axis) around an `hk.remat`'d block; untied vocabulary head."""
  import haiku as hk  # pylint: disable=g-import-not-at-top

  class Block(hk.Module):
    def __call__(self, x):
      b, s, _ = x.shape
      lin = lambda o, name: hk.Linear(o, with_bias=False, name=name)  # noqa: E731
      kv = LM_KV_HEADS * LM_HEAD_DIM
      h = hk.RMSNorm(-1, name="attn_norm")(x)
      q = _rope(lin(LM_DIM, "q")(h).reshape(b, s, LM_HEADS, LM_HEAD_DIM))
      k = _rope(lin(kv, "k")(h).reshape(b, s, LM_KV_HEADS, LM_HEAD_DIM))
      v = lin(kv, "v")(h).reshape(b, s, LM_KV_HEADS, LM_HEAD_DIM)
      x = x + lin(LM_DIM, "o")(_gqa(q, k, v).reshape(b, s, LM_DIM))
      h = hk.RMSNorm(-1, name="mlp_norm")(x)
      return x + lin(LM_DIM, "down")(jax.nn.silu(lin(LM_FF, "gate")(h)) * lin(LM_FF, "up")(h))

  def forward(ids):
    x = hk.Embed(VOCAB, LM_DIM, name="embed")(ids)
    block = hk.remat(lambda x: Block(name="block")(x))
    x = hk.layer_stack(LM_LAYERS, name="layers")(block)(x)
    return hk.Linear(VOCAB, with_bias=False, name="head")(hk.RMSNorm(-1, name="final_norm")(x))

  blk = "layers/block"
  w = lambda m: ("dense", "kron", (f"{m}/w",))  # noqa: E731
  rms = lambda m: ("scale_and_shift", "full", (f"{m}/scale",))  # noqa: E731
  z = _hk_zoo(
    forward,
    _lm_batch(13),
    [("embedding", "kron", ("embed/embeddings",)), rms("final_norm"), w("head")]
    + [rms(f"{blk}/attn_norm"), w(f"{blk}/down"), w(f"{blk}/gate"), w(f"{blk}/k")]
    + [rms(f"{blk}/mlp_norm"), w(f"{blk}/o"), w(f"{blk}/q"), w(f"{blk}/up"), w(f"{blk}/v")],
  )
  z.check = _stacks(LM_LAYERS, blk)
  return z


def equinox_lm() -> Zoo:
  """The decoder LM in equinox: the blocks created stacked by `eqx.filter_vmap` over keys, run
  by `jax.lax.scan` over their array leaves (`eqx.partition` / `eqx.combine`), the scan body
  `eqx.filter_checkpoint`'d; one sequence per call, vmapped over the batch; the head tied to
  the embedding (`h @ embedding.T`): one embedding layer with two uses."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  kv = LM_KV_HEADS * LM_HEAD_DIM

  class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 7)
      lin = lambda i, o, key: eqx.nn.Linear(i, o, use_bias=False, key=key)  # noqa: E731
      self.attn_norm = eqx.nn.RMSNorm(LM_DIM, use_bias=False)
      self.q, self.o = lin(LM_DIM, LM_DIM, k[0]), lin(LM_DIM, LM_DIM, k[3])
      self.k, self.v = lin(LM_DIM, kv, k[1]), lin(LM_DIM, kv, k[2])
      self.mlp_norm = eqx.nn.RMSNorm(LM_DIM, use_bias=False)
      self.gate, self.up = lin(LM_DIM, LM_FF, k[4]), lin(LM_DIM, LM_FF, k[5])
      self.down = lin(LM_FF, LM_DIM, k[6])

    def __call__(self, x):  # One sequence [S, D]; `_rope` and `_gqa` take a batch axis of 1.
      s = x.shape[0]
      tok = jax.vmap  # Equinox layers act on one token.
      h = tok(self.attn_norm)(x)
      q = _rope(tok(self.q)(h).reshape(1, s, LM_HEADS, LM_HEAD_DIM))
      k = _rope(tok(self.k)(h).reshape(1, s, LM_KV_HEADS, LM_HEAD_DIM))
      v = tok(self.v)(h).reshape(1, s, LM_KV_HEADS, LM_HEAD_DIM)
      x = x + tok(self.o)(_gqa(q, k, v).reshape(s, LM_DIM))
      h = tok(self.mlp_norm)(x)
      return x + tok(self.down)(jax.nn.silu(tok(self.gate)(h)) * tok(self.up)(h))

  class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # Every array leaf has a leading layer axis.
    final_norm: eqx.nn.RMSNorm

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.embed = eqx.nn.Embedding(VOCAB, LM_DIM, key=k1)
      self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, LM_LAYERS))
      self.final_norm = eqx.nn.RMSNorm(LM_DIM, use_bias=False)

    def __call__(self, ids):  # One sequence of ids [S].
      dynamic, static = eqx.partition(self.blocks, eqx.is_array)

      @eqx.filter_checkpoint
      def layer(x, block):
        return eqx.combine(block, static)(x), None

      x, _ = jax.lax.scan(layer, jax.vmap(self.embed)(ids), dynamic)
      return jax.vmap(self.final_norm)(x) @ self.embed.weight.T

  w = lambda m: ("dense", "kron", (f"blocks/{m}/weight",))  # noqa: E731
  rms = lambda m: ("scale_and_shift", "full", (f"{m}/weight",))  # noqa: E731

  def check(specs):
    _stacks(LM_LAYERS, "blocks/")(specs)
    assert [s.num_uses for s in specs if s.kind == "embedding"] == [2]

  z = _eqx_zoo(
    eqx.filter_jit(LM)(_key(14)),
    _lm_batch(15),
    lambda m, x: jax.vmap(m)(x),
    # The tied table (a lookup and the head): one layer of two uses, kron_indep.
    [("embedding", "kron_indep", ("embed/weight",)), rms("blocks/attn_norm")]
    + [w("q"), w("k"), w("v"), w("o"), rms("blocks/mlp_norm"), w("gate"), w("up"), w("down")]
    + [rms("final_norm")],
  )
  z.check = check
  return z


VIT_LAYERS, VIT_HEADS = 1, 2  # One block: a second adds compile time, no new structure.


def haiku_vit() -> Zoo:
  """A small ViT in Haiku: a strided `hk.Conv2D` patch embedding, a learned positional table
  `x + pos` (`hk.get_parameter` at the top level: path `~/pos_embedding`, a diagonal block),
  pre-LN blocks of `hk.MultiHeadAttention` and a GELU MLP, LayerNorm, mean pool, dense head."""
  import haiku as hk  # pylint: disable=g-import-not-at-top

  ln = lambda name: hk.LayerNorm(-1, True, True, name=name)  # noqa: E731

  def forward(x):
    x = hk.Conv2D(DIM, 2, stride=2, padding="VALID", name="patch")(x)  # [N, 4, 4, D]
    x = x.reshape(x.shape[0], -1, DIM)
    init = hk.initializers.RandomNormal(0.02)
    x = x + hk.get_parameter("pos_embedding", (1, x.shape[1], DIM), init=init)
    for i in range(VIT_LAYERS):
      h = ln(f"ln_att{i}")(x)
      att = hk.MultiHeadAttention(
        VIT_HEADS, DIM // VIT_HEADS, w_init=hk.initializers.VarianceScaling(), name=f"att{i}"
      )
      x = x + att(h, h, h)
      h = jax.nn.gelu(hk.Linear(2 * DIM, name=f"mlp{i}_in")(ln(f"ln_mlp{i}")(x)))
      x = x + hk.Linear(DIM, name=f"mlp{i}_out")(h)
    return hk.Linear(CLASSES, name="head")(jnp.mean(ln("ln")(x), axis=1))

  wb = lambda m: ("dense", "kron", (f"{m}/w", f"{m}/b"))  # noqa: E731
  norm = lambda m: ("scale_and_shift", "full", (f"{m}/scale", f"{m}/offset"))  # noqa: E731
  att = [wb(f"att{i}/{p}") for i in range(VIT_LAYERS) for p in ("key", "linear", "query", "value")]
  return _hk_zoo(
    forward,
    _images(_key(0)),
    att
    + [wb("head"), norm("ln")]
    + [norm(f"ln_{m}{i}") for m in ("att", "mlp") for i in range(VIT_LAYERS)]
    + [wb(f"mlp{i}_{m}") for i in range(VIT_LAYERS) for m in ("in", "out")]
    + [
      ("conv", "kron", ("patch/w", "patch/b")),
      ("scale_and_shift", "diagonal", ("~/pos_embedding",)),
    ],
  )


def equinox_vit() -> Zoo:
  """The ViT in equinox, one image per call (vmapped over the batch): channel-first patch
  `eqx.nn.Conv2d`, a positional table field `[L, D]`, `eqx.nn.MultiheadAttention` (no biases)
  on the token sequence, LayerNorm and MLP vmapped over tokens."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class Layer(eqx.Module):
    ln_att: eqx.nn.LayerNorm
    att: eqx.nn.MultiheadAttention
    ln_mlp: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 3)
      self.ln_att, self.ln_mlp = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
      self.att = eqx.nn.MultiheadAttention(VIT_HEADS, DIM, key=k[0])
      self.mlp_in = eqx.nn.Linear(DIM, 2 * DIM, key=k[1])
      self.mlp_out = eqx.nn.Linear(2 * DIM, DIM, key=k[2])

    def __call__(self, x):  # Tokens [L, D].
      h = jax.vmap(self.ln_att)(x)
      x = x + self.att(h, h, h)
      mlp = lambda t: self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln_mlp(t))))  # noqa: E731
      return x + jax.vmap(mlp)(x)

  class ViT(eqx.Module):
    patch: eqx.nn.Conv2d
    pos_embedding: jax.Array
    layers: tuple[Layer, ...]
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 3 + VIT_LAYERS)
      self.patch = eqx.nn.Conv2d(3, DIM, 2, stride=2, key=k[0])
      self.pos_embedding = 0.02 * jax.random.normal(k[1], (16, DIM))
      self.layers = tuple(Layer(k[3 + i]) for i in range(VIT_LAYERS))
      self.ln = eqx.nn.LayerNorm(DIM)
      self.head = eqx.nn.Linear(DIM, CLASSES, key=k[2])

    def __call__(self, x):  # One image [H, W, C].
      x = self.patch(x.transpose(2, 0, 1))  # [D, 4, 4]
      x = x.reshape(DIM, -1).T + self.pos_embedding
      for layer in self.layers:
        x = layer(x)
      return self.head(jnp.mean(jax.vmap(self.ln)(x), axis=0))

  norm = lambda m: ("scale_and_shift", "full", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  w = lambda m: ("dense", "kron", (f"{m}/weight",))  # noqa: E731
  wb = lambda m: ("dense", "kron", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  layer = lambda p: (  # noqa: E731
    [norm(f"{p}/ln_att")]
    + [w(f"{p}/att/{q}_proj") for q in ("query", "key", "value", "output")]
    + [norm(f"{p}/ln_mlp"), wb(f"{p}/mlp_in"), wb(f"{p}/mlp_out")]
  )
  return _eqx_zoo(
    eqx.filter_jit(ViT)(_key(16)),
    _images(_key(0)),
    lambda m, x: jax.vmap(m)(x),
    [("conv", "kron", ("patch/weight", "patch/bias"))]
    + [("scale_and_shift", "diagonal", ("pos_embedding",))]
    + [e for i in range(VIT_LAYERS) for e in layer(f"layers/{i}")]
    + [norm("ln"), wb("head")],
  )


def haiku_lstm() -> Zoo:
  """`hk.LSTM` run by `hk.dynamic_unroll` (a `lax.scan` over time closing over the cell's
  params): its one `hk.Linear` over `[x, h]` (all four gates) is a shared dense layer with one
  use a step."""
  import haiku as hk  # pylint: disable=g-import-not-at-top

  steps, hidden = 5, 6

  def forward(x):  # [N, T, F]
    core = hk.LSTM(hidden, name="lstm")
    ys, _ = hk.dynamic_unroll(core, x, core.initial_state(x.shape[0]), time_major=False)
    return hk.Linear(CLASSES, name="head")(ys[:, -1])

  k1, k2 = jax.random.split(_key(17))
  batch = {"x": jax.random.normal(k1, (N, steps, 4)), "y": jax.random.randint(k2, (N,), 0, CLASSES)}

  def check(specs):
    uses = {s.param_paths[0]: s.num_uses for s in specs}
    assert uses == {"head/w": 1, "lstm/linear/w": steps}, uses

  z = _hk_zoo(
    forward,
    batch,
    [
      ("dense", "kron", ("head/w", "head/b")),
      ("dense", "kron_indep", ("lstm/linear/w", "lstm/linear/b")),
    ],
  )
  z.check = check
  return z


def haiku_moe() -> Zoo:
  """A token classifier with a residual top-2-of-4 MoE block in Haiku (`hk.get_parameter`
  expert stacks). `w_in` multiplies the tokens shared by all experts, `[T, D] x [E, D, F]`: one
  dense layer whose output features are the E x F expert units (a finer block than E separate
  ones); `w_out` multiplies each expert's own hidden units, `[E, T, F] x [E, F, D]`: a stack of
  E dense layers. The load-balancing term is added to the loss, unregistered."""
  import haiku as hk  # pylint: disable=g-import-not-at-top

  class MoE(hk.Module):
    """Top-k MoE MLP over tokens `[T, D]` with expert-stacked kernels `[E, D, F]`, `[E, F, D]`
    used by einsum. Every expert runs on every token (no dispatch); `combine` (the
    renormalised top-k gates, zero elsewhere) keeps each token's k experts."""

    def __call__(self, x):
      e, d = MOE_EXPERTS, x.shape[-1]
      probs = jax.nn.softmax(hk.Linear(e, with_bias=False, name="router")(x))
      gate, idx = jax.lax.top_k(probs, MOE_TOP_K)
      gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
      combine = jnp.einsum("tk,tke->te", gate, jax.nn.one_hot(idx, e))
      init = hk.initializers.VarianceScaling(fan_in_axes=(1,))
      w_in = hk.get_parameter("w_in", (e, d, MOE_HIDDEN), init=init)
      w_out = hk.get_parameter("w_out", (e, MOE_HIDDEN, d), init=init)
      h = jax.nn.gelu(jnp.einsum("td,edf->etf", x, w_in))
      y = jnp.einsum("te,etd->td", combine, jnp.einsum("etf,efd->etd", h, w_out))
      used = jnp.mean(jnp.sum(jax.nn.one_hot(idx, e), axis=1), axis=0) / MOE_TOP_K
      return y, e * jnp.sum(used * jnp.mean(probs, axis=0))

  def forward(x):
    n, s, _ = x.shape
    h = hk.Linear(8, name="embed")(x)
    tokens = hk.LayerNorm(-1, True, True, name="norm")(h).reshape(n * s, 8)
    y, balance = MoE(name="moe")(tokens)
    return hk.Linear(CLASSES, name="head")(jnp.mean(h + y.reshape(n, s, 8), axis=1)), balance

  f = hk.without_apply_rng(hk.transform(forward))
  kx, ky = jax.random.split(_key(18))
  batch = {"x": jax.random.normal(kx, (N, 3, 6)), "y": jax.random.randint(ky, (N,), 0, CLASSES)}
  params = jax.jit(f.init)(_key(1), batch["x"])

  def loss_fn(p, b):
    logits, balance = f.apply(p, b["x"])
    return _ce(logits, b["y"]) + 0.01 * balance

  def check(specs):
    shapes = {s.param_paths[0]: (s.stack_size, s.factor_shapes) for s in specs}
    e, f_ = MOE_EXPERTS, MOE_HIDDEN
    assert shapes["moe/w_in"] == (0, ((8, 8), (e * f_, e * f_))), shapes
    assert shapes["moe/w_out"] == (e, ((e, f_, f_), (e, 8, 8))), shapes

  wb = lambda m: ("dense", "kron", (f"{m}/w", f"{m}/b"))  # noqa: E731
  return Zoo(
    loss_fn,
    params,
    batch,
    [wb("embed"), wb("head")]
    + [("dense", "kron", (f"moe/{m}",)) for m in ("w_in", "w_out", "router/w")]
    + [("scale_and_shift", "full", ("norm/scale", "norm/offset"))],
    check=check,
  )


def equinox_vae() -> Zoo:
  """The VAE of `vae` in equinox, one example per call: an `eqx.nn.MLP` encoder trunk, one
  `eqx.nn.Linear` giving mean and log-variance together (split after), the reparameterised
  z = mean + σ ε with ε from a per-example key, an `eqx.nn.MLP` decoder. Trained on the negative
  ELBO with only the Bernoulli reconstruction registered (see `vae`)."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class VAE(eqx.Module):
    enc: eqx.nn.MLP
    stats: eqx.nn.Linear
    dec: eqx.nn.MLP

    def __init__(self, key):
      k = jax.random.split(key, 3)
      self.enc = eqx.nn.MLP(VAE_PIXELS, 16, 16, 1, activation=jax.nn.relu, key=k[0])
      self.stats = eqx.nn.Linear(16, 2 * VAE_LATENT, key=k[1])
      self.dec = eqx.nn.MLP(VAE_LATENT, VAE_PIXELS, 16, 1, activation=jax.nn.relu, key=k[2])

    def __call__(self, x, key):
      mean, logvar = jnp.split(self.stats(jax.nn.relu(self.enc(x))), 2)
      z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
      return self.dec(z), mean, logvar

  kx, kn = jax.random.split(_key(19))
  x = (jax.random.uniform(kx, (N, VAE_PIXELS)) < 0.3).astype(jnp.float32)
  params, static = eqx.partition(eqx.filter_jit(VAE)(_key(20)), eqx.is_array)

  def loss_fn(p, b):
    keys = jax.random.split(b["noise"], b["x"].shape[0])
    logits, mean, logvar = jax.vmap(eqx.combine(p, static))(b["x"], keys)
    return _neg_elbo(logits, mean, logvar, b["x"])

  wb = lambda m: ("dense", "kron", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  return Zoo(
    loss_fn,
    params,
    {"x": x, "noise": kn},
    [wb("enc/layers/0"), wb("enc/layers/1"), wb("stats"), wb("dec/layers/0"), wb("dec/layers/1")],
  )


HX_MODELS = {
  "haiku_lm": haiku_lm,
  "equinox_lm": equinox_lm,
  "haiku_vit": haiku_vit,
  "equinox_vit": equinox_vit,
  "haiku_lstm": haiku_lstm,
  "haiku_moe": haiku_moe,
  "equinox_vae": equinox_vae,
}
STRUCTURE_MODELS.update(HX_MODELS)


# ==============================================================================================
# Structure zoo, second part (real model code keeps its structure): a small ViT in
# linen and nnx, an nnx LSTM (`nnx.RNN`), a linen GRU (`nn.RNN`), the nnx twins of the top-k
# mixture of experts and of the VAE.
# ==============================================================================================

VIT_PATCH, VIT_MLP = 4, 16
VIT_TOKENS = (8 // VIT_PATCH) ** 2  # 8x8 images


def _vit_batch():
  return _images(_key(20))


class LinenViTBlock(nn.Module):
  """Pre-LayerNorm encoder block: self-attention, then an MLP, each residual."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(nn.LayerNorm(name="ln1")(x))
    h = nn.gelu(nn.Dense(VIT_MLP, name="fc1")(nn.LayerNorm(name="ln2")(x)))
    return x + nn.Dense(DIM, name="fc2")(h)


class LinenViT(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(DIM, (VIT_PATCH, VIT_PATCH), strides=VIT_PATCH, name="patch")(x)
    x = x.reshape(x.shape[0], -1, DIM)  # [N, L, D]
    pos = self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], DIM))
    x = LinenViTBlock(name="block")(x + pos)
    return nn.Dense(CLASSES, name="head")(jnp.mean(nn.LayerNorm(name="ln_f")(x), axis=1))


class NnxViT(nnx.Module):
  """The classic ViT readout: a learned class token `[1, 1, D]` is broadcast over the batch and
  prepended to the patch tokens; the head reads its final state (the linen twin mean-pools)."""

  def __init__(self, rngs):
    p = VIT_PATCH
    self.patch = nnx.Conv(3, DIM, (p, p), strides=p, rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, DIM)))
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, 1 + VIT_TOKENS, DIM)))
    self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
    self.fc1 = nnx.Linear(DIM, VIT_MLP, rngs=rngs)
    self.fc2 = nnx.Linear(VIT_MLP, DIM, rngs=rngs)
    self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.patch(x).reshape(x.shape[0], -1, DIM)
    cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, DIM))
    x = jnp.concatenate([cls, x], axis=1) + self.pos
    x = x + self.attn(self.ln1(x))
    x = x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
    return self.head(self.ln_f(x)[:, 0])


def _vit_expected(blk, extra=()):
  """The layers of either ViT; `blk` prefixes the block's layers (linen nests them)."""
  pos = ("scale_and_shift", "diagonal", ("pos",))  # The default for a learned table.
  attn = [_dense(f"{blk}attn/{n}") for n in ("key", "out", "query", "value")]
  block = attn + [_dense(f"{blk}fc1"), _dense(f"{blk}fc2"), _norm(f"{blk}ln1"), _norm(f"{blk}ln2")]
  return sorted(
    block + [_dense("head"), _norm("ln_f"), _conv("patch"), pos, *extra], key=lambda e: e[2]
  )


def vit_linen() -> Zoo:
  f, p, b = _linen(LinenViT(), _vit_batch())
  return Zoo(f, p, b, _vit_expected("block/"))


def vit_nnx() -> Zoo:
  """The class token is `0 + cls` in its slot of the concatenation: a shift-only layer over D
  ("full", unlike the positional table's "diagonal")."""
  f, p, b = _nnx(_nnx_build(NnxViT), _vit_batch())
  return Zoo(f, p, b, _vit_expected("", [("scale_and_shift", "full", ("cls",))]))


RNN_STEPS, RNN_HIDDEN, RNN_IN = 5, 6, 4


def _seq_batch(seed):
  k1, k2 = jax.random.split(_key(seed))
  return {
    "x": jax.random.normal(k1, (N, RNN_STEPS, RNN_IN)),
    "y": jax.random.randint(k2, (N,), 0, CLASSES),
  }


def _uses_check(expected_uses):
  def check(specs):
    uses = {s.param_paths[0]: s.num_uses for s in specs}
    assert uses == expected_uses, uses

  return check


class NnxRNNClassifier(nnx.Module):
  """`nnx.RNN` over a cell, a linear head on the last output. The cells: `OptimizedLSTMCell`
  (its input and recurrent kernels each one `Linear` of the four gates), the unfused
  `LSTMCell` (eight gate `Linear`s: `ii`, `if_`, ... input ones without bias, `hi`, `hf`, ...
  recurrent ones with), `GRUCell` (gates fused: one input and one recurrent `Linear`, split
  three ways after the product)."""

  def __init__(self, cell, rngs):
    self.rnn = nnx.RNN(cell(RNN_IN, RNN_HIDDEN, rngs=rngs))
    self.head = nnx.Linear(RNN_HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(x)[:, -1])


def lstm_nnx() -> Zoo:
  f, p, b = _nnx(_nnx_build(NnxRNNClassifier, nnx.OptimizedLSTMCell), _seq_batch(21))
  c = "rnn/cell"
  z = Zoo(
    f,
    p,
    b,
    [
      _dense("head"),
      ("dense", "kron_indep", (f"{c}/dense_h/kernel", f"{c}/dense_h/bias")),
      ("dense", "kron_indep", (f"{c}/dense_i/kernel",)),
    ],
  )
  z.check = _uses_check(
    {f"{c}/dense_h/kernel": RNN_STEPS, f"{c}/dense_i/kernel": RNN_STEPS, "head/kernel": 1}
  )
  return z


class LinenGRU(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.RNN(nn.GRUCell(RNN_HIDDEN), name="rnn")(x)
    return nn.Dense(CLASSES, name="head")(y[:, -1])


def gru_linen() -> Zoo:
  """`nn.RNN(nn.GRUCell)`: six gate `Dense` layers, each shared over the steps (kron_indep);
  the input ones and the candidate's recurrent one (`hn`, scaled by the reset gate after its
  bias) carry biases, `hr` and `hz` none."""
  f, p, b = _linen(LinenGRU(), _seq_batch(22))
  c = "GRUCell_0"  # nn.RNN adds no scope of its own to the cell params.
  gate = lambda g, bias: ("dense", "kron_indep", _dense(f"{c}/{g}", bias)[2])  # noqa: E731
  z = Zoo(
    f,
    p,
    b,
    [gate("hn", True), gate("hr", False), gate("hz", False)]
    + [gate("in", True), gate("ir", True), gate("iz", True), _dense("head")],
  )
  z.check = _uses_check(
    {f"{c}/{g}/kernel": RNN_STEPS for g in ("hn", "hr", "hz", "in", "ir", "iz")}
    | {"head/kernel": 1}
  )
  return z


def lstm_cell_nnx() -> Zoo:
  f, p, b = _nnx(_nnx_build(NnxRNNClassifier, nnx.LSTMCell), _seq_batch(25))
  c = "rnn/cell"
  gate = lambda g, bias: ("dense", "kron_indep", _dense(f"{c}/{g}", bias)[2])  # noqa: E731
  return Zoo(
    f,
    p,
    b,
    [_dense("head")]
    + [gate(g, True) for g in ("hf", "hg", "hi", "ho")]
    + [gate(g, False) for g in ("if_", "ig", "ii", "io")],
  )


def gru_nnx() -> Zoo:
  f, p, b = _nnx(_nnx_build(NnxRNNClassifier, nnx.GRUCell), _seq_batch(26))
  c = "rnn/cell"
  return Zoo(
    f,
    p,
    b,
    [
      _dense("head"),
      ("dense", "kron_indep", (f"{c}/dense_h/kernel",)),
      ("dense", "kron_indep", (f"{c}/dense_i/kernel", f"{c}/dense_i/bias")),
    ],
  )


class NnxMoE(nnx.Module):
  """The nnx twin of `LinenMoE`: a dense router, expert-stacked kernels `[E, D, F]`, `[E, F, D]`
  applied by einsum, top-k gates, a load-balancing term."""

  def __init__(self, d, rngs):
    e = MOE_EXPERTS
    init = nnx.initializers.lecun_normal(batch_axis=(0,))
    self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)
    self.w_in = nnx.Param(init(rngs.params(), (e, d, MOE_HIDDEN)))
    self.w_out = nnx.Param(init(rngs.params(), (e, MOE_HIDDEN, d)))

  def __call__(self, x):  # [T, D]
    e = MOE_EXPERTS
    probs = jax.nn.softmax(self.router(x))
    gate, idx = jax.lax.top_k(probs, MOE_TOP_K)
    gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(idx, e) * gate[..., None], axis=1)  # [T, E]
    dispatch = jnp.sum(jax.nn.one_hot(idx, e), axis=1)
    xe = jnp.einsum("te,td->etd", dispatch, x)
    h = nnx.gelu(jnp.einsum("etd,edf->etf", xe, self.w_in[...]))
    ye = jnp.einsum("etf,efd->etd", h, self.w_out[...])
    balance = e * jnp.sum(jnp.mean(dispatch, axis=0) / MOE_TOP_K * jnp.mean(probs, axis=0))
    return jnp.einsum("te,etd->td", combine, ye), balance


class NnxMoEModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.moe = NnxMoE(8, rngs)
    self.head = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    n, s, _ = x.shape
    h = self.embed(x)
    y, balance = self.moe(self.norm(h).reshape(n * s, 8))
    h = h + y.reshape(n, s, 8)
    return self.head(jnp.mean(h, axis=1)), balance


def moe_nnx() -> Zoo:
  kx, ky = jax.random.split(_key(23))
  batch = {"x": jax.random.normal(kx, (N, 3, 6)), "y": jax.random.randint(ky, (N,), 0, CLASSES)}
  graphdef, params = nnx.split(_nnx_build(NnxMoEModel), nnx.Param)

  def loss_fn(p, b):
    logits, balance = nnx.merge(graphdef, p)(b["x"])
    return _ce(logits, b["y"]) + 0.01 * balance

  return _moe_zoo(loss_fn, params, batch)


class NnxVAE(nnx.Module):
  """The nnx twin of `LinenVAE`; the noise comes from the `rngs` passed to the call."""

  def __init__(self, rngs):
    self.enc = nnx.Linear(VAE_PIXELS, 16, rngs=rngs)
    self.mean = nnx.Linear(16, VAE_LATENT, rngs=rngs)
    self.logvar = nnx.Linear(16, VAE_LATENT, rngs=rngs)
    self.dec = nnx.Linear(VAE_LATENT, 16, rngs=rngs)
    self.dec_out = nnx.Linear(16, VAE_PIXELS, rngs=rngs)

  def __call__(self, x, rngs):
    h = nnx.relu(self.enc(x))
    mean, logvar = self.mean(h), self.logvar(h)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(rngs.noise(), mean.shape)
    return self.dec_out(nnx.relu(self.dec(z))), mean, logvar


def vae_nnx() -> Zoo:
  """The negative ELBO of `vae`, the reconstruction registered, the KL term not; the noise key
  comes from the batch."""
  kx, kn = jax.random.split(_key(24))
  x = (jax.random.uniform(kx, (N, VAE_PIXELS)) < 0.3).astype(jnp.float32)
  graphdef, params = nnx.split(_nnx_build(NnxVAE), nnx.Param)

  def loss_fn(p, b):
    logits, mean, logvar = nnx.merge(graphdef, p)(b["x"], nnx.Rngs(noise=b["noise"]))
    return _neg_elbo(logits, mean, logvar, b["x"])

  return Zoo(
    loss_fn,
    params,
    {"x": x, "noise": kn},
    [_dense(m) for m in ("dec", "dec_out", "enc", "logvar", "mean")],
  )


STRUCTURE_MODELS.update(
  {
    "vit_linen": vit_linen,
    "vit_nnx": vit_nnx,
    "lstm_nnx": lstm_nnx,
    "gru_linen": gru_linen,
    "lstm_cell_nnx": lstm_cell_nnx,
    "gru_nnx": gru_nnx,
    "moe_nnx": moe_nnx,
    "vae_nnx": vae_nnx,
  }
)


# -- a WaveNet-style TCN and a DiT block with adaLN-Zero -----------------------------------------

TCN_STEPS, TCN_WIDTH, TCN_DILATIONS = 16, 6, (1, 2, 4)


class LinenTCN(nn.Module):
  """Causal dilated 1-D convolutions with WaveNet's gated unit, `tanh(f) · σ(g)` from one
  convolution of twice the width split in two, a 1×1 skip convolution per layer and a 1×1
  residual one on all but the last (whose residual output nothing reads), and a per-step
  classifier over the summed skips."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(TCN_WIDTH, (1,), name="inp")(x)
    skips = 0.0
    for i, d in enumerate(TCN_DILATIONS):
      fg = nn.Conv(2 * TCN_WIDTH, (2,), kernel_dilation=(d,), padding="CAUSAL", name=f"dil{i}")(x)
      f, g = jnp.split(fg, 2, axis=-1)
      h = jnp.tanh(f) * jax.nn.sigmoid(g)
      if i < len(TCN_DILATIONS) - 1:
        x = x + nn.Conv(TCN_WIDTH, (1,), name=f"res{i}")(h)
      skips = skips + nn.Conv(TCN_WIDTH, (1,), name=f"skip{i}")(h)
    return nn.Conv(CLASSES, (1,), name="out")(jax.nn.relu(skips))


def tcn_linen() -> Zoo:
  """Per-step labels `[N, T]`, the loss their mean cross-entropy: the convolutions' statistics
  sum over batch and time, and the dilated ones see left-padded inputs."""
  kx, ky = jax.random.split(_key(25))
  batch = {
    "x": jax.random.normal(kx, (N, TCN_STEPS, 2)),
    "y": jax.random.randint(ky, (N, TCN_STEPS), 0, CLASSES),
  }
  f, p, b = _linen(LinenTCN(), batch)
  names = ["inp", "out", "res0", "res1"] + [f"{k}{i}" for k in ("dil", "skip") for i in range(3)]

  def check(specs):
    dil = {s.name: s.info.rhs_dilation for s in specs if s.name.startswith("dil")}
    assert dil == {f"dil{i}": (d,) for i, d in enumerate(TCN_DILATIONS)}, dil

  return Zoo(f, p, b, [_conv(n) for n in sorted(names)], check=check)


DIT_TOKENS, DIT_IN, DIT_DIM, DIT_LABELS = 5, 4, 8, 3


class NnxDiTBlock(nnx.Module):
  """adaLN-Zero: a zero-initialised projection of the conditioning gives each sub-layer's shift,
  scale and gate; the norms have no parameters of their own."""

  def __init__(self, rngs):
    d = DIT_DIM
    self.ada = nnx.Linear(d, 6 * d, kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.ln1 = nnx.LayerNorm(d, use_scale=False, use_bias=False, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, d, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, use_scale=False, use_bias=False, rngs=rngs)
    self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
    self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x, c):
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(self.ada(nnx.silu(c)), 6, axis=-1)
    h = self.ln1(x) * (1 + scale1[:, None]) + shift1[:, None]
    x = x + gate1[:, None] * self.attn(h)
    h = self.ln2(x) * (1 + scale2[:, None]) + shift2[:, None]
    return x + gate2[:, None] * self.fc2(nnx.gelu(self.fc1(h)))


class NnxDiT(nnx.Module):
  """A diffusion transformer's denoiser: noisy tokens in, the noise predicted per token, the
  conditioning a sinusoidal embedding of the time step through an MLP plus a class embedding."""

  def __init__(self, rngs):
    d = DIT_DIM
    self.inp = nnx.Linear(DIT_IN, d, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, DIT_TOKENS, d)))
    self.t1 = nnx.Linear(d, d, rngs=rngs)
    self.t2 = nnx.Linear(d, d, rngs=rngs)
    self.label = nnx.Embed(DIT_LABELS, d, rngs=rngs)
    self.block = NnxDiTBlock(rngs)
    self.final_ada = nnx.Linear(d, 2 * d, kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.final_ln = nnx.LayerNorm(d, use_scale=False, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(d, DIT_IN, rngs=rngs)

  def __call__(self, x, t, label):
    freqs = jnp.exp(-jnp.log(1000.0) * jnp.arange(DIT_DIM // 2) / (DIT_DIM // 2))
    emb = jnp.concatenate([jnp.sin(t[:, None] * freqs), jnp.cos(t[:, None] * freqs)], axis=-1)
    c = self.t2(nnx.silu(self.t1(emb))) + self.label(label)
    x = self.block(self.inp(x) + self.pos, c)
    shift, scale = jnp.split(self.final_ada(nnx.silu(c)), 2, axis=-1)
    return self.out(self.final_ln(x) * (1 + scale[:, None]) + shift[:, None])


def dit_nnx() -> Zoo:
  """The denoising loss: x_t = √ᾱ x₀ + √(1-ᾱ) ε, the squared error of the predicted ε (the
  registered loss; `register_squared_error_loss` is the sum of squares, so the mean over the
  batch is scaled to match)."""
  k0, ke, kt, kl = jax.random.split(_key(26), 4)
  x0 = jax.random.normal(k0, (N, DIT_TOKENS, DIT_IN))
  eps = jax.random.normal(ke, x0.shape)
  t = jax.random.uniform(kt, (N,))
  alpha_bar = jnp.cos(0.5 * jnp.pi * t)[:, None, None] ** 2
  batch = {
    "x": jnp.sqrt(alpha_bar) * x0 + jnp.sqrt(1 - alpha_bar) * eps,
    "t": t,
    "label": jax.random.randint(kl, (N,), 0, DIT_LABELS),
    "eps": eps,
  }
  graphdef, params = nnx.split(_nnx_build(NnxDiT), nnx.Param)

  def loss_fn(p, b):
    pred = nnx.merge(graphdef, p)(b["x"], b["t"], b["label"])
    kfac_jax.register_squared_error_loss(pred, b["eps"])
    return jnp.sum((pred - b["eps"]) ** 2) / pred.shape[0]

  blk = [_dense(f"block/{n}") for n in ("ada", "fc1", "fc2")]
  blk += [_dense(f"block/attn/{n}") for n in ("key", "out", "query", "value")]
  layers = blk + [_dense(n) for n in ("final_ada", "inp", "out", "t1", "t2")]
  layers += [
    ("embedding", "kron", ("label/embedding",)),
    ("scale_and_shift", "diagonal", ("pos",)),
  ]
  return Zoo(loss_fn, params, batch, sorted(layers, key=lambda e: e[2]))


STRUCTURE_MODELS.update({"tcn_linen": tcn_linen, "dit_nnx": dit_nnx})


# -- Perceiver, MLP-Mixer, graph network ----------------------------------------------------------

PERCEIVER_LATENTS, PERCEIVER_DIM, PERCEIVER_INPUTS = 3, 8, 6


class LinenPerceiver(nn.Module):
  """A Perceiver-style encoder: a learned latent array, broadcast over the batch, cross-attends
  to the projected inputs, then one latent self-attention block; mean-pooled latents feed the
  classifier after a final LayerNorm. The broadcast latents are read twice (the query LayerNorm
  and the residual)."""

  @nn.compact
  def __call__(self, x):
    d = PERCEIVER_DIM
    lat = self.param("latents", nn.initializers.normal(0.02), (PERCEIVER_LATENTS, d))
    lat = jnp.broadcast_to(lat, (x.shape[0],) + lat.shape)
    kv = nn.LayerNorm(name="ln_kv")(nn.Dense(d, name="inp")(x))
    lat = lat + nn.MultiHeadDotProductAttention(HEADS, name="cross")(
      nn.LayerNorm(name="ln_q")(lat), kv
    )
    lat = lat + nn.SelfAttention(HEADS, name="self")(nn.LayerNorm(name="ln_self")(lat))
    h = nn.gelu(nn.Dense(2 * d, name="fc1")(nn.LayerNorm(name="ln_mlp")(lat)))
    lat = lat + nn.Dense(d, name="fc2")(h)
    return nn.Dense(CLASSES, name="head")(nn.LayerNorm(name="ln_out")(lat).mean(1))


def perceiver_linen() -> Zoo:
  kx, ky = jax.random.split(_key(27))
  batch = {
    "x": jax.random.normal(kx, (N, PERCEIVER_INPUTS, 4)),
    "y": jax.random.randint(ky, (N,), 0, CLASSES),
  }
  f, p, b = _linen(LinenPerceiver(), batch)
  attn = lambda m: [_dense(f"{m}/{n}") for n in ("key", "out", "query", "value")]  # noqa: E731
  layers = attn("cross") + attn("self") + [_dense(n) for n in ("fc1", "fc2", "head", "inp")]
  layers += [_norm(n) for n in ("ln_kv", "ln_mlp", "ln_out", "ln_q", "ln_self")]
  layers.append(("scale_and_shift", "diagonal", ("latents",)))

  def check(specs):
    (lat,) = [s for s in specs if s.name == "latents"]
    assert lat.info.feature_shape == (PERCEIVER_LATENTS, PERCEIVER_DIM), lat.info

  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), check=check)


MIXER_PATCH, MIXER_DIM = 4, 8
MIXER_TOKENS = (8 // MIXER_PATCH) ** 2


class NnxMixerBlock(nnx.Module):
  """MLP-Mixer: the token-mixing MLP is `nnx.Linear` over the token axis, reached by a
  `swapaxes`; the channel-mixing MLP over the channels."""

  def __init__(self, rngs):
    t, d = MIXER_TOKENS, MIXER_DIM
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.tok1 = nnx.Linear(t, 2 * t, rngs=rngs)
    self.tok2 = nnx.Linear(2 * t, t, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.ch1 = nnx.Linear(d, 2 * d, rngs=rngs)
    self.ch2 = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    h = self.ln1(x).swapaxes(1, 2)  # [N, D, T]
    x = x + self.tok2(nnx.gelu(self.tok1(h))).swapaxes(1, 2)
    return x + self.ch2(nnx.gelu(self.ch1(self.ln2(x))))


class NnxMixer(nnx.Module):
  def __init__(self, rngs):
    p = MIXER_PATCH
    self.stem = nnx.Conv(3, MIXER_DIM, (p, p), strides=(p, p), rngs=rngs)
    self.blocks = nnx.List([NnxMixerBlock(rngs) for _ in range(2)])
    self.ln = nnx.LayerNorm(MIXER_DIM, rngs=rngs)
    self.head = nnx.Linear(MIXER_DIM, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    x = x.reshape(x.shape[0], -1, MIXER_DIM)  # [N, T, D]
    for blk in self.blocks:
      x = blk(x)
    return self.head(self.ln(x).mean(1))


def mixer_nnx() -> Zoo:
  f, p, b = _nnx(_nnx_build(NnxMixer), _images(_key(28)))
  blk = [_dense(f"blocks/{i}/{n}") for i in range(2) for n in ("ch1", "ch2", "tok1", "tok2")] + [
    _norm(f"blocks/{i}/{n}") for i in range(2) for n in ("ln1", "ln2")
  ]
  layers = blk + [_dense("head"), _norm("ln"), _conv("stem")]

  def check(specs):
    tok = [s for s in specs if s.name.endswith("tok1")]
    # The token MLP reads [N, D, T]: its rows are the examples' channels, its inputs the tokens.
    assert len(tok) == 2, tok
    assert all((s.info.in_dim, s.info.rows) == (MIXER_TOKENS, N * MIXER_DIM) for s in tok), tok

  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), check=check)


GNN_GRAPHS, GNN_NODES, GNN_EDGES, GNN_DIM = N, 3, 5, 6


def gnn_haiku() -> Zoo:
  """A message-passing graph network over a batch of small graphs (Haiku): edge messages from
  the concatenated end-point features, summed into nodes with `jax.ops.segment_sum`, a residual
  node update, then a per-graph sum readout. The examples are graphs; the dense layers' rows are
  the edges and the nodes."""
  import haiku as hk  # pylint: disable=g-import-not-at-top

  nodes, edges = GNN_GRAPHS * GNN_NODES, GNN_GRAPHS * GNN_EDGES
  k = jax.random.split(_key(29), 4)
  graph = jnp.repeat(jnp.arange(GNN_GRAPHS), GNN_NODES)
  local = jax.random.randint(k[0], (2, edges), 0, GNN_NODES)  # Edges stay inside their graph.
  offset = jnp.repeat(jnp.arange(GNN_GRAPHS) * GNN_NODES, GNN_EDGES)
  batch = {
    "x": jax.random.normal(k[1], (nodes, 3)),
    "senders": local[0] + offset,
    "receivers": local[1] + offset,
    "graph": graph,
    "y": jax.random.randint(k[2], (GNN_GRAPHS,), 0, CLASSES),
  }

  def net(b):
    h = jax.nn.relu(hk.Linear(GNN_DIM, name="encode")(b["x"]))
    for i in range(2):
      pair = jnp.concatenate([h[b["senders"]], h[b["receivers"]]], axis=-1)
      msg = jax.nn.relu(hk.Linear(GNN_DIM, name=f"message_{i}")(pair))
      agg = jax.ops.segment_sum(msg, b["receivers"], num_segments=nodes)
      h = h + jax.nn.relu(hk.Linear(GNN_DIM, name=f"update_{i}")(jnp.concatenate([h, agg], -1)))
    pooled = jax.ops.segment_sum(h, b["graph"], num_segments=GNN_GRAPHS)
    return hk.Linear(CLASSES, name="readout")(pooled)

  f = hk.without_apply_rng(hk.transform(net))
  params = jax.jit(f.init)(_key(1), batch)

  def loss_fn(p, b):
    return _ce(f.apply(p, b), b["y"])

  names = ["encode", "message_0", "message_1", "readout", "update_0", "update_1"]
  layers = [("dense", "kron", (f"{n}/w", f"{n}/b")) for n in names]
  return Zoo(loss_fn, params, batch, layers)


STRUCTURE_MODELS.update(
  {"perceiver_linen": perceiver_linen, "mixer_nnx": mixer_nnx, "gnn_haiku": gnn_haiku}
)


class LinenGpt2(nn.Module):
  """GPT-2 as flax ports write it: token and position tables as two `nn.Embed`, the positions
  looked up at `jnp.arange(T)` (`wpe`), pre-norm blocks with causal self-attention and a GELU
  MLP, the head tied to the token table (`wte.attend`)."""

  @nn.compact
  def __call__(self, tokens):
    wte = nn.Embed(VOCAB, DIM, name="wte")
    h = wte(tokens) + nn.Embed(SEQ, DIM, name="wpe")(jnp.arange(tokens.shape[1]))
    for i in range(2):
      a = nn.LayerNorm(name=f"ln_{i}a")(h)
      mask = nn.make_causal_mask(tokens)
      h = h + nn.SelfAttention(HEADS, name=f"attn_{i}")(a, mask=mask)
      m = nn.gelu(nn.Dense(4 * DIM, name=f"fc_{i}")(nn.LayerNorm(name=f"ln_{i}b")(h)))
      h = h + nn.Dense(DIM, name=f"proj_{i}")(m)
    return wte.attend(nn.LayerNorm(name="ln_f")(h))


def gpt2_linen() -> Zoo:
  f, p, b = _linen(LinenGpt2(), _lm_batch(29))
  layers = [("embedding", "kron_indep", ("wte/embedding",))]
  layers.append(("scale_and_shift", "diagonal", ("wpe/embedding",)))
  for i in range(2):
    layers += [_dense(f"attn_{i}/{n}") for n in ("key", "out", "query", "value")]
    layers += [_dense(f"fc_{i}"), _dense(f"proj_{i}"), _norm(f"ln_{i}a"), _norm(f"ln_{i}b")]
  layers.append(_norm("ln_f"))

  def check(specs):
    (wpe,) = [s for s in specs if s.param_paths == ("wpe/embedding",)]
    assert wpe.info.feature_shape == (SEQ, DIM), wpe.info

  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), check=check)


STRUCTURE_MODELS["gpt2_linen"] = gpt2_linen


CLIP_FRAMES, CLIP_DIM = 2, 8


class LinenTimeSformer(nn.Module):
  """A TimeSformer-style video classifier (divided space-time attention): each frame embedded
  by a patch conv over `(b f) h w c`, attention over time on `(b p) f d` rows and over space on
  `(b f) p d` rows (each a merge of the batch with another axis, example-major), with per-head
  qk-normalisation (`normalize_qk=True`: a LayerNorm on `[(b p), f, heads, head_dim]`). The 2x2
  patches per frame equal the zoo's batch of 4, so only the batch axis followed from the input
  tells the space attention's rows apart."""

  @nn.compact
  def __call__(self, clips):
    n, f = clips.shape[:2]
    x = nn.Conv(CLIP_DIM, (4, 4), strides=(4, 4), name="patch")(clips.reshape(n * f, 8, 8, 3))
    p = x.shape[1] * x.shape[2]
    x = x.reshape(n, f, p, CLIP_DIM)
    for i in range(1):
      t = x.transpose(0, 2, 1, 3).reshape(n * p, f, CLIP_DIM)
      t = nn.SelfAttention(2, normalize_qk=True, name=f"time_{i}")(nn.LayerNorm(name=f"ln_t{i}")(t))
      x = x + t.reshape(n, p, f, CLIP_DIM).transpose(0, 2, 1, 3)
      s = x.reshape(n * f, p, CLIP_DIM)
      s = nn.SelfAttention(2, name=f"space_{i}")(nn.LayerNorm(name=f"ln_s{i}")(s))
      x = x + s.reshape(n, f, p, CLIP_DIM)
      m = nn.Dense(2 * CLIP_DIM, name=f"fc1_{i}")(nn.LayerNorm(name=f"ln_m{i}")(x))
      x = x + nn.Dense(CLIP_DIM, name=f"fc2_{i}")(nn.gelu(m))
    return nn.Dense(CLASSES, name="head")(x.mean((1, 2)))


def timesformer_linen() -> Zoo:
  kx, ky = jax.random.split(_key(30))
  batch = {
    "x": jax.random.normal(kx, (N, CLIP_FRAMES, 8, 8, 3)),
    "y": jax.random.randint(ky, (N,), 0, CLASSES),
  }
  f, p, b = _linen(LinenTimeSformer(), batch)
  layers = [_conv("patch"), _dense("head")]
  for i in range(1):
    for a in (f"time_{i}", f"space_{i}"):
      layers += [_dense(f"{a}/{n}") for n in ("key", "out", "query", "value")]
    layers += [("scale_and_shift", "full", (f"time_{i}/{n}_ln/scale",)) for n in ("key", "query")]
    layers += [_norm(f"ln_{k}{i}") for k in "tsm"]
    layers += [_dense(f"fc1_{i}"), _dense(f"fc2_{i}")]
  # Ten unclipped steps of 0.05 at λ 1e-2 on these 4 clips diverge, with the batch axis found
  # by sizes too (and with the qk-norms diagonal): the steps of a fixed learning rate are too
  # long for this model at that damping. λ 0.1 trains it; so does `kfac` on its defaults
  # (`benchmarks/zoo_defaults.py --models timesformer_linen`: none diverged at lr 0.3, 1, 3).
  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), damping=0.1)


STRUCTURE_MODELS["timesformer_linen"] = timesformer_linen


# -- Normalisations: equinox GroupNorm, LayerNorm on graph rows, a vmapped BatchNorm ensemble -----


def equinox_unet() -> Zoo:
  """A small equinox U-Net in the diffusion style: channel-first convolutions, each followed by
  `eqx.nn.GroupNorm` and SiLU (the module sees one example, `[C, H, W]`; vmapped outside), a
  strided conv down, nearest-neighbour upsampling and a conv back up, the skip concatenated on
  channels, a 1x1 conv to per-pixel logits. The labels are per pixel."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  k = jax.random.split(_key(31), 4)

  class Block(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm

    def __init__(self, cin, cout, key, stride=1):
      self.conv = eqx.nn.Conv2d(cin, cout, 3, stride=stride, padding=1, key=key)
      self.norm = eqx.nn.GroupNorm(2, cout)

    def __call__(self, x):
      return jax.nn.silu(self.norm(self.conv(x)))

  class UNet(eqx.Module):
    enc: Block
    down: Block
    up: Block
    out: eqx.nn.Conv2d

    def __init__(self, key):
      k = jax.random.split(key, 4)
      self.enc = Block(3, 4, k[0])
      self.down = Block(4, 8, k[1], stride=2)
      self.up = Block(8, 4, k[2])
      self.out = eqx.nn.Conv2d(8, CLASSES, 1, key=k[3])

    def __call__(self, x):  # One image [H, W, C].
      e = self.enc(x.transpose(2, 0, 1))
      d = self.down(e)
      u = self.up(jnp.repeat(jnp.repeat(d, 2, axis=1), 2, axis=2))
      return self.out(jnp.concatenate([e, u], axis=0)).transpose(1, 2, 0)

  batch = _images(k[1])
  batch["y"] = jax.random.randint(k[2], (N, 8, 8), 0, CLASSES)
  expected = []
  for b in ("enc", "down", "up"):  # The layers in the module's field order.
    expected.append(("conv", "kron", (f"{b}/conv/weight", f"{b}/conv/bias")))
    expected.append(("scale_and_shift", "full", (f"{b}/norm/weight", f"{b}/norm/bias")))
  expected.append(("conv", "kron", ("out/weight", "out/bias")))
  z = _eqx_zoo(UNet(k[0]), batch, lambda m, x: jax.vmap(m)(x), expected)

  def check(specs):  # The group norms scale the channel axis of [N, C, H, W].
    norms = [s for s in specs if s.kind == "scale_and_shift"]
    assert [s.info.feature_axis for s in norms] == [1, 1, 1], norms

  return dataclasses.replace(z, check=check)


GN_NODES, GN_EDGES = (2, 4, 3, 5), (3, 5, 2, 5)  # per graph: the graphs differ in size


class LinenGraphNet(nn.Module):
  """A jraph-style GraphNet in linen: the nodes of all graphs concatenated into one
  `[num_nodes, features]` array, edges as `senders` / `receivers` into it; each round an edge
  MLP on (edge, sender, receiver) features and a node MLP on (node, summed messages), each
  followed by a LayerNorm over the rows (edges, nodes); a per-graph sum readout."""

  @nn.compact
  def __call__(self, b):
    nodes = b["x"].shape[0]
    h = nn.Dense(GNN_DIM, name="node_enc")(b["x"])
    e = nn.Dense(GNN_DIM, name="edge_enc")(b["edges"])
    for i in range(2):
      pair = jnp.concatenate([e, h[b["senders"]], h[b["receivers"]]], axis=-1)
      e = nn.LayerNorm(name=f"edge_ln_{i}")(jax.nn.relu(nn.Dense(GNN_DIM, name=f"edge_{i}")(pair)))
      agg = jax.ops.segment_sum(e, b["receivers"], num_segments=nodes)
      upd = nn.Dense(GNN_DIM, name=f"node_{i}")(jnp.concatenate([h, agg], axis=-1))
      h = nn.LayerNorm(name=f"node_ln_{i}")(h + jax.nn.relu(upd))
    pooled = jax.ops.segment_sum(h, b["graph"], num_segments=len(GN_NODES))
    return nn.Dense(CLASSES, name="readout")(pooled)


def graphnet_linen() -> Zoo:
  """The loss is per graph (the examples); the LayerNorms' rows are nodes and edges, so their
  statistics take each row as one (`ScaleShiftInfo.example_rows` False)."""
  k = jax.random.split(_key(32), 5)
  nodes, edges = sum(GN_NODES), sum(GN_EDGES)
  start = jnp.cumsum(jnp.asarray((0,) + GN_NODES[:-1]))
  size = jnp.repeat(jnp.asarray(GN_NODES), jnp.asarray(GN_EDGES))
  offset = jnp.repeat(start, jnp.asarray(GN_EDGES))
  ends = jax.random.randint(k[0], (2, edges), 0, 1 << 16) % size + offset  # Inside each graph.
  batch = {
    "x": jax.random.normal(k[1], (nodes, 3)),
    "edges": jax.random.normal(k[2], (edges, 2)),
    "senders": ends[0],
    "receivers": ends[1],
    "graph": jnp.repeat(jnp.arange(len(GN_NODES)), jnp.asarray(GN_NODES)),
    "y": jax.random.randint(k[3], (len(GN_NODES),), 0, CLASSES),
  }
  model = LinenGraphNet()
  params = jax.jit(model.init)(k[4], batch)["params"]

  def loss_fn(p, b):
    return _ce(model.apply({"params": p}, b), b["y"])

  names = ["edge_0", "edge_1", "edge_enc", "node_0", "node_1", "node_enc", "readout"]
  layers = [_dense(n) for n in names]
  layers += [_norm(f"{w}_ln_{i}") for w in ("edge", "node") for i in range(2)]

  def check(specs):
    norms = [s for s in specs if s.kind == "scale_and_shift"]
    assert len(norms) == 4 and not any(s.info.example_rows for s in norms), norms

  return Zoo(loss_fn, params, batch, sorted(layers, key=lambda e: e[2]), check=check)


ENSEMBLE = 3


class LinenEnsembleMember(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.BatchNorm(use_running_average=False, name="bn_0")(nn.Dense(16, name="fc_0")(x)))
    h = nn.relu(nn.BatchNorm(use_running_average=False, name="bn_1")(nn.Dense(16, name="fc_1")(h)))
    return nn.Dense(CLASSES, name="head")(h)


class LinenEnsemble(nn.Module):
  """A deep ensemble of BatchNorm'd MLPs, built by `nn.vmap` over stacked parameters and batch
  statistics (every member sees the same batch), the logits averaged over the members."""

  @nn.compact
  def __call__(self, x):
    members = nn.vmap(
      LinenEnsembleMember,
      in_axes=None,
      out_axes=0,
      variable_axes={"params": 0, "batch_stats": 0},
      split_rngs={"params": True},
      axis_size=ENSEMBLE,
    )(name="members")
    return members(x.reshape(x.shape[0], -1)).mean(0)


def ensemble_batchnorm_linen() -> Zoo:
  f, p, b = _linen(
    LinenEnsemble(), _images(_key(33), hw=4), extra_vars=("batch_stats",), mutable=True
  )
  layers = [_norm(f"members/bn_{i}") for i in range(2)]
  layers += [_dense(f"members/{n}") for n in ("fc_0", "fc_1", "head")]

  def check(specs):  # Stacks of ENSEMBLE layers, one block per member.
    assert all(s.stack_size == ENSEMBLE for s in specs), specs

  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), check=check)


# -- layers every example reads the same way: a MAP head, T5's relative bias, GPT-2's `wpe` ------


class LinenMapHead(nn.Module):
  """Multihead attention pooling as big_vision's ViT heads write it: a learned probe
  `[1, 1, D]` tiled over the batch is the query of a `MultiHeadDotProductAttention` over the
  tokens, then a LayerNorm and a residual GELU MLP; the pooled token is the probe's row."""

  mlp_dim: int
  heads: int

  @nn.compact
  def __call__(self, tokens):
    n, _, d = tokens.shape
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d), tokens.dtype)
    pooled = nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(
      jnp.tile(probe, (n, 1, 1)), tokens
    )
    y = nn.gelu(nn.Dense(self.mlp_dim, name="mlp_in")(nn.LayerNorm(name="ln")(pooled)))
    return (pooled + nn.Dense(d, name="mlp_out")(y))[:, 0]


class LinenMapViT(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(DIM, (2, 2), strides=(2, 2), name="patch")(x)
    x = x.reshape(x.shape[0], -1, DIM)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], DIM))
    x = LinenMapHead(2 * DIM, HEADS, name="map")(nn.LayerNorm(name="ln_pre")(x))
    return nn.Dense(CLASSES, name="head")(x)


def map_head_linen() -> Zoo:
  """The tiled probe is learned tokens (a shift-only layer over D), and the query projection
  that reads it a dense layer whose one input row every example shares."""
  f, p, b = _linen(LinenMapViT(), _images(_key(31)))
  attn = [_dense(f"map/attn/{n}") for n in ("key", "out", "query", "value")]
  layers = [_dense("head"), *attn, _norm("map/ln"), _dense("map/mlp_in"), _dense("map/mlp_out")]
  layers += [("scale_and_shift", "full", ("map/probe",)), _conv("patch")]
  layers += [_norm("ln_pre"), ("scale_and_shift", "diagonal", ("pos",))]

  def check(specs):
    (q,) = [s for s in specs if s.name == "map/attn/query"]
    assert q.info.rows == N, q.info  # One row per example: the tiled probe.

  # λ = 0.1: at 1e-2 the ten unclipped steps of lr 0.05 diverge whatever block the query
  # kernel or the probe gets (their "diagonal" blocks diverge too).
  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), check=check, damping=0.1)


T5_BUCKETS, T5_MAX_DISTANCE = 8, 16


def _t5_bucket(relative, num_buckets=T5_BUCKETS, max_distance=T5_MAX_DISTANCE):
  """Bidirectional relative-position buckets (T5): half the buckets per direction, exact for
  small distances, log-spaced up to `max_distance`."""
  half = num_buckets // 2
  bucket = jnp.where(relative > 0, half, 0)
  dist = jnp.abs(relative)
  exact = half // 2
  log_part = jnp.log(jnp.maximum(dist, 1) / exact) / np.log(max_distance / exact)
  far = jnp.minimum(exact + (log_part * (half - exact)).astype(jnp.int32), half - 1)
  return bucket + jnp.where(dist < exact, dist, far)


class LinenT5Layer(nn.Module):
  """A T5 encoder layer: RMSNorm, attention without biases whose logits get a learned
  `[buckets, heads]` bias looked up (`nn.Embed`) at buckets of the relative positions, then a
  ReLU MLP; the buckets come from positions alone."""

  @nn.compact
  def __call__(self, x):
    n, t, _ = x.shape
    h = nn.RMSNorm(name="ln_attn")(x)
    proj = lambda name: nn.DenseGeneral((HEADS, DIM // HEADS), use_bias=False, name=name)  # noqa: E731
    q, k, v = proj("q")(h), proj("k")(h), proj("v")(h)
    pos = jnp.arange(t)
    buckets = _t5_bucket(pos[None, :] - pos[:, None])
    bias = nn.Embed(T5_BUCKETS, HEADS, name="relative_attention_bias")(buckets)  # [q, k, heads]
    logits = jnp.einsum("nqhd,nkhd->nhqk", q, k) + jnp.transpose(bias, (2, 0, 1))[None]
    att = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(logits, axis=-1), v)
    x = x + nn.DenseGeneral(DIM, axis=(-2, -1), use_bias=False, name="o")(att)
    m = nn.relu(nn.Dense(2 * DIM, use_bias=False, name="wi")(nn.RMSNorm(name="ln_mlp")(x)))
    return x + nn.Dense(DIM, use_bias=False, name="wo")(m)


class LinenT5Classifier(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, DIM, name="embed")(tokens)
    x = LinenT5Layer(name="layer")(x)
    return nn.Dense(CLASSES, name="head")(nn.RMSNorm(name="ln_f")(x).mean(1))


def t5_relative_bias_linen() -> Zoo:
  """The relative bias table, gathered at constant buckets (with repeats), is a shift-only
  layer ("diagonal", each bucket's gradient summed over the (q, k) pairs in it)."""
  kx, ky = jax.random.split(_key(32))
  batch = {
    "x": jax.random.randint(kx, (N, SEQ), 0, VOCAB),
    "y": jax.random.randint(ky, (N,), 0, CLASSES),
  }
  f, p, b = _linen(LinenT5Classifier(), batch)
  scale = lambda n: ("scale_and_shift", "full", (f"{n}/scale",))  # noqa: E731
  layers = [("embedding", "kron", ("embed/embedding",)), _dense("head")]
  layers += [scale("layer/ln_attn"), scale("layer/ln_mlp"), scale("ln_f")]
  layers += [_dense(f"layer/{n}", bias=False) for n in ("k", "o", "q", "v")]
  layers.append(("scale_and_shift", "diagonal", ("layer/relative_attention_bias/embedding",)))
  layers += [_dense(f"layer/{n}", bias=False) for n in ("wi", "wo")]

  def check(specs):
    (rel,) = [s for s in specs if s.name == "layer/relative_attention_bias"]
    assert rel.info.feature_shape == (HEADS, SEQ, SEQ) and rel.info.feature_index, rel.info

  return Zoo(f, p, b, sorted(layers, key=lambda e: e[2]), check=check)


GPT2_POSITIONS = 16  # `n_positions`: the table is longer than the sequence.


class LinenGpt2Embeddings(nn.Module):
  """GPT-2's input embeddings as Hugging Face's Flax model writes them: `position_ids`
  broadcast from `arange(seq)` over the batch, inside the model, looked up in a `wpe` table of
  `n_positions` rows; one pre-norm MLP block and a mean-pooled classifier."""

  @nn.compact
  def __call__(self, input_ids):
    position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1])[None, :], input_ids.shape)
    h = nn.Embed(VOCAB, DIM, name="wte")(input_ids.astype("i4"))
    h = h + nn.Embed(GPT2_POSITIONS, DIM, name="wpe")(position_ids.astype("i4"))
    m = nn.gelu(nn.Dense(4 * DIM, name="c_fc")(nn.LayerNorm(name="ln_1")(h)))
    h = h + nn.Dense(DIM, name="c_proj")(m)
    return nn.Dense(CLASSES, name="head")(nn.LayerNorm(name="ln_f")(h).mean(1))


def gpt2_positions_linen() -> Zoo:
  """`wpe` read at position ids built inside the model is a positional table, as in
  `gpt2_linen` (a shift-only "diagonal" layer); its rows past the sequence are never read."""
  kx, ky = jax.random.split(_key(33))
  batch = {
    "x": jax.random.randint(kx, (N, SEQ), 0, VOCAB),
    "y": jax.random.randint(ky, (N,), 0, CLASSES),
  }
  f, p, b = _linen(LinenGpt2Embeddings(), batch)
  layers = [_dense("c_fc"), _dense("c_proj"), _dense("head"), _norm("ln_1"), _norm("ln_f")]
  layers += [("scale_and_shift", "diagonal", ("wpe/embedding",))]
  layers += [("embedding", "kron", ("wte/embedding",))]

  def check(specs):
    (wpe,) = [s for s in specs if s.name == "wpe"]
    assert wpe.info.feature_shape == (SEQ, DIM), wpe.info
    assert "positional embedding" in wpe.note, wpe.note

  return Zoo(f, p, b, layers, check=check)


STRUCTURE_MODELS.update(
  {
    "equinox_unet": equinox_unet,
    "graphnet_linen": graphnet_linen,
    "ensemble_batchnorm_linen": ensemble_batchnorm_linen,
    "map_head_linen": map_head_linen,
    "t5_relative_bias_linen": t5_relative_bias_linen,
    "gpt2_positions_linen": gpt2_positions_linen,
  }
)


# -- physics-informed networks written per point ----------------------------------------------
# The operators as most PINN code writes them: a function of one point, differentiated with
# `jax.jvp`, `jax.grad` or `jax.hessian` and vmapped over the points. `jax.vmap` hoists a
# product by a constant tangent direction or seed out of the batch, and a reverse-mode
# derivative reads each kernel transposed; both are uses of one shared dense layer.

PINN_SIZES = (2, 8, 1)


def _pinn_point(params, y):
  """The network of `examples/pinn_poisson.py` at one point `y: [d]`, a scalar."""
  for i, p in enumerate(params):
    y = y @ p["w"] + p["b"]
    if i < len(params) - 1:
      y = jnp.tanh(y)
  return y[0]


def _laplacian_vmap_jvp(params, x):
  """Nested `jax.jvp` along each axis at one point, vmapped."""

  def one(y):
    u = lambda z: _pinn_point(params, z)  # noqa: E731
    eye = jnp.eye(y.shape[0], dtype=y.dtype)
    du = lambda z, e: jax.jvp(u, (z,), (e,))[1]  # noqa: E731
    return sum(jax.jvp(lambda z, e=e: du(z, e), (y,), (e,))[1] for e in eye)

  return jax.vmap(one)(x)


def _laplacian_hessian(params, x):
  return jax.vmap(lambda y: jnp.trace(jax.hessian(lambda z: _pinn_point(params, z))(y)))(x)


def _pinn_poisson_zoo(laplacian, expected_approx="kron_terms") -> Zoo:
  """The 2-d Poisson problem of `pinn_poisson` (16 interior, 8 boundary points, float32) with
  the Laplacian `laplacian(params, x)`."""
  from examples import pinn_poisson as pp

  def loss_fn(params, batch):
    x = batch["interior"]
    residual = (laplacian(params, x) + pp.source(x))[:, None]
    kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
    u = jax.vmap(lambda y: _pinn_point(params, y))(batch["boundary"])[:, None]
    kfac_jax.register_normal_predictive_distribution(u, var=1.0)
    return 0.5 * jnp.mean(residual**2) + 0.5 * jnp.mean(u**2)

  params = pp.init_params(0, PINN_SIZES, jnp.float32)
  batch = pp.make_problem(0, n_interior=16, n_boundary=8, dtype=jnp.float32).batch
  expected = [("dense", expected_approx, (f"{i}/w", f"{i}/b")) for i in range(2)]
  return Zoo(loss_fn, params, batch, expected)


def pinn_vmap_jvp() -> Zoo:
  """The per-point Laplacian by nested `jax.jvp` under `jax.vmap`: the first layer's tangent
  products are computed once for all points (hoisted), tapped where each point reads them."""
  return _pinn_poisson_zoo(_laplacian_vmap_jvp)


def pinn_hessian() -> Zoo:
  """The Laplacian as the trace of `jax.hessian` (jacfwd of jacrev) per point: each kernel is
  also read transposed by the backward pass, and the output layer's backward seed is hoisted."""
  return _pinn_poisson_zoo(_laplacian_hessian)


def pinn_grad_grad() -> Zoo:
  """The 1-d Poisson problem −u'' = π² sin(πx) on [0, 1], u(0) = u(1) = 0, with u'' by
  `jax.vmap(jax.grad(jax.grad(u)))` (reverse over reverse)."""
  from examples import pinn_poisson as pp

  def loss_fn(params, batch):
    x = batch["interior"]
    u = lambda t: _pinn_point(params, t[None])  # noqa: E731
    residual = (jax.vmap(jax.grad(jax.grad(u)))(x) + jnp.pi**2 * jnp.sin(jnp.pi * x))[:, None]
    kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
    ub = jax.vmap(u)(batch["boundary"])[:, None]
    kfac_jax.register_normal_predictive_distribution(ub, var=1.0)
    return 0.5 * jnp.mean(residual**2) + 0.5 * jnp.mean(ub**2)

  params = pp.init_params(0, (1, 8, 1), jnp.float32)
  batch = {
    "interior": jnp.linspace(0.05, 0.95, 16, dtype=jnp.float32),
    "boundary": jnp.array([0.0, 1.0] * 4, jnp.float32),
  }
  expected = [("dense", "kron_terms", (f"{i}/w", f"{i}/b")) for i in range(2)]
  return Zoo(loss_fn, params, batch, expected)


def pinn_heat() -> Zoo:
  """The heat equation u_t = u_xx on points `(t, x)`, per point: u_t from `jax.grad`, u_xx
  from `jax.hessian`, vmapped; boundary (x = 0, 1) and initial (t = 0) terms. Three loss
  tags: the shared layers pool them ("kron_indep")."""
  from examples import pinn_poisson as pp

  def loss_fn(params, batch):
    p = batch["interior"]
    u = lambda y: _pinn_point(params, y)  # noqa: E731
    residual = jax.vmap(lambda y: jax.grad(u)(y)[0] - jax.hessian(u)(y)[1, 1])(p)[:, None]
    kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
    ub = jax.vmap(u)(batch["boundary"])[:, None]
    kfac_jax.register_normal_predictive_distribution(ub, var=1.0)
    p0 = batch["initial"]
    u0 = (jax.vmap(u)(p0) - jnp.sin(jnp.pi * p0[:, 1]))[:, None]
    kfac_jax.register_normal_predictive_distribution(u0, var=1.0)
    return 0.5 * (jnp.mean(residual**2) + jnp.mean(ub**2) + jnp.mean(u0**2))

  params = pp.init_params(0, PINN_SIZES, jnp.float32)
  grid = np.linspace(0.1, 0.9, 4, dtype=np.float32)
  edge = np.linspace(0.0, 1.0, 8, dtype=np.float32)
  batch = {
    "interior": jnp.asarray(np.stack(np.meshgrid(grid, grid), -1).reshape(-1, 2)),
    "boundary": jnp.asarray(np.stack([edge, np.arange(8) % 2], 1).astype(np.float32)),
    "initial": jnp.asarray(np.stack([np.zeros(8, np.float32), edge], 1)),
  }
  expected = [("dense", "kron_indep", (f"{i}/w", f"{i}/b")) for i in range(2)]
  return Zoo(loss_fn, params, batch, expected)


STRUCTURE_MODELS.update(
  {
    "pinn_vmap_jvp": pinn_vmap_jvp,
    "pinn_hessian": pinn_hessian,
    "pinn_grad_grad": pinn_grad_grad,
    "pinn_heat": pinn_heat,
  }
)
