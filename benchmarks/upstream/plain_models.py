"""The benchmark models in plain jax, for the upstream worker (its venv has no Flax).

Each function computes exactly what the Flax model of the same name computes in
`examples/autoencoder.py`, `examples/cnn.py` and `examples/transformer_lm.py`, on the same
parameter tree (Flax names, `[in, out]` kernels), written the way a plain-jax user would write it:
`x @ kernel + bias`, `lax.conv_general_dilated`, `einsum` for the attention projections, an index
into the embedding table and `x @ table.T` for the tied output. Upstream's graph matcher sees
these jaxprs, so what it registers is what it would register for such a user.
`tests/test_benchmark_harness.py` checks them against the Flax models.

Imports only jax and numpy: this module is loaded by the worker in upstream's venv and by the
tests in ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_LN_EPS = 1e-6  # flax.linen.LayerNorm's default epsilon.


def autoencoder(params: Mapping[str, Any], x: jax.Array, activations: Sequence[str]):
  """`dense_i` layers, tanh or identity after each (`activations[i]`); returns logits."""
  for i, act in enumerate(activations):
    layer = params["params"][f"dense_{i}"]
    x = x @ layer["kernel"] + layer["bias"]
    if act == "tanh":
      x = jnp.tanh(x)
    elif act != "linear":
      raise ValueError(f"activations[{i}] must be 'tanh' or 'linear', got {act!r}.")
  return x


def layer_norm(p: Mapping[str, Any], x: jax.Array) -> jax.Array:
  """Normalisation over the last axis, variance as E[x²] − E[x]² (Flax's fast variance)."""
  mean = x.mean(-1, keepdims=True)
  var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
  return (x - mean) * jax.lax.rsqrt(var + _LN_EPS) * p["scale"] + p["bias"]


def cnn(params: Mapping[str, Any], x: jax.Array, num_convs: int):
  """`Conv_i` (3x3, SAME) → `LayerNorm_i` → relu → 2x2 average pool, then `Dense_0`."""
  p = params["params"]
  for i in range(num_convs):
    conv = p[f"Conv_{i}"]
    x = jax.lax.conv_general_dilated(x, conv["kernel"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = x + conv["bias"]
    x = jax.nn.relu(layer_norm(p[f"LayerNorm_{i}"], x))
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).mean((2, 4))
  x = x.reshape(x.shape[0], -1)
  return x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]


def _attention(p: Mapping[str, Any], x: jax.Array) -> jax.Array:
  """Causal multi-head self-attention with Flax's `[d, heads, head_dim]` projection kernels."""
  q = jnp.einsum("bld,dhk->blhk", x, p["query"]["kernel"]) + p["query"]["bias"]
  k = jnp.einsum("bld,dhk->blhk", x, p["key"]["kernel"]) + p["key"]["bias"]
  v = jnp.einsum("bld,dhk->blhk", x, p["value"]["kernel"]) + p["value"]["bias"]
  q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  logits = jnp.einsum("bqhk,bshk->bhqs", q, k)
  length = x.shape[1]
  causal = np.tril(np.ones((length, length), bool))
  logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhqs,bshk->bqhk", weights, v)
  return jnp.einsum("bqhk,hkd->bqd", out, p["out"]["kernel"]) + p["out"]["bias"]


def transformer(params: Mapping[str, Any], ids: jax.Array, num_layers: int):
  """Pre-LayerNorm blocks (attention, then a gelu MLP), tied output `x @ embedding.T`."""
  p = params["params"]
  table = p["Embed_0"]["embedding"]
  x = table[ids] + p["pos"][:ids.shape[1]]
  for i in range(num_layers):
    blk = p[f"Block_{i}"]
    x = x + _attention(blk["MultiHeadDotProductAttention_0"], layer_norm(blk["LayerNorm_0"], x))
    h = layer_norm(blk["LayerNorm_1"], x) @ blk["Dense_0"]["kernel"] + blk["Dense_0"]["bias"]
    x = x + jax.nn.gelu(h, approximate=True) @ blk["Dense_1"]["kernel"] + blk["Dense_1"]["bias"]
  return layer_norm(p["LayerNorm_0"], x) @ table.T


def apply(config: Mapping[str, Any], params, inputs):
  """The model of `config["model"]` ("autoencoder", "cnn", "transformer") on `inputs`."""
  model = config.get("model", "autoencoder")
  if model == "autoencoder":
    return autoencoder(params, inputs, config["activations"])
  if model == "cnn":
    return cnn(params, inputs, config["num_convs"])
  if model == "transformer":
    return transformer(params, inputs, config["num_layers"])
  raise ValueError(f"config['model'] must be 'autoencoder', 'cnn' or 'transformer', got "
                   f"{model!r}.")
