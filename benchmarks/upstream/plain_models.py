"""The benchmark models in plain jax, for the upstream worker (its venv has no Flax).

Each function computes exactly what the Flax model of the same name computes in
`examples/autoencoder.py`, `examples/cnn.py` and `examples/transformer_lm.py`, on the same
parameter tree (Flax names, `[in, out]` kernels), written the way a plain-jax user would write it:
`x @ kernel + bias`, `lax.conv_general_dilated`, an index into the embedding table and
`x @ table.T` for the tied output. The attention projections take their kernels as 2-D matrices
(`attention_to_2d`; the worker converts the parameters on the way in and back on the way out).
Upstream's graph matcher sees these jaxprs, so what it registers is what it would register for
such a user.
`tests/benchmarks/test_harness.py` checks them against the Flax models.

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
    x = jax.lax.conv_general_dilated(
      x, conv["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    x = x + conv["bias"]
    x = jax.nn.relu(layer_norm(p[f"LayerNorm_{i}"], x))
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).mean((2, 4))
  x = x.reshape(x.shape[0], -1)
  return x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]


def attention_to_2d(params: Mapping[str, Any]) -> dict:
  """Flax's attention projections `[d, heads, head_dim]` / `[heads, head_dim, d]` as 2-D
  `[d, heads·head_dim]` / `[heads·head_dim, d]` matrices (biases flattened alike).

  The plain-jax Transformer computes its projections as `x @ W + b` on these, the form a
  plain-jax user writes and upstream's dense matcher handles (its repeated-dense block assumes
  one output feature axis). Same numbers, same Kronecker factors (d and heads·head_dim).
  """

  def convert(tree, name=""):
    if not isinstance(tree, Mapping):
      return tree
    if name.startswith("MultiHeadDotProductAttention"):
      out = {}
      for proj, p in tree.items():
        k, b = np.asarray(p["kernel"]), np.asarray(p["bias"])
        if proj == "out":
          out[proj] = {"kernel": k.reshape(-1, k.shape[-1]), "bias": b}
        else:
          out[proj] = {"kernel": k.reshape(k.shape[0], -1), "bias": b.reshape(-1)}
      return out
    return {k: convert(v, k) for k, v in tree.items()}

  return convert(params)


def attention_from_2d(params: Mapping[str, Any], heads: int) -> dict:
  """The inverse of `attention_to_2d` for `heads` attention heads."""

  def convert(tree, name=""):
    if not isinstance(tree, Mapping):
      return tree
    if name.startswith("MultiHeadDotProductAttention"):
      out = {}
      for proj, p in tree.items():
        k, b = np.asarray(p["kernel"]), np.asarray(p["bias"])
        if proj == "out":
          out[proj] = {"kernel": k.reshape(heads, -1, k.shape[-1]), "bias": b}
        else:
          out[proj] = {"kernel": k.reshape(k.shape[0], heads, -1), "bias": b.reshape(heads, -1)}
      return out
    return {k: convert(v, k) for k, v in tree.items()}

  return convert(params)


def _attention(p: Mapping[str, Any], x: jax.Array, heads: int) -> jax.Array:
  """Causal multi-head self-attention on the 2-D projections of `attention_to_2d`."""
  b, length, _ = x.shape
  split = lambda y: y.reshape(b, length, heads, -1)  # noqa: E731
  q = split(x @ p["query"]["kernel"] + p["query"]["bias"])
  k = split(x @ p["key"]["kernel"] + p["key"]["bias"])
  v = split(x @ p["value"]["kernel"] + p["value"]["bias"])
  q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  logits = jnp.einsum("bqhk,bshk->bhqs", q, k)
  causal = np.tril(np.ones((length, length), bool))
  logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhqs,bshk->bqhk", weights, v).reshape(b, length, -1)
  return out @ p["out"]["kernel"] + p["out"]["bias"]


def transformer(params: Mapping[str, Any], ids: jax.Array, num_layers: int, heads: int):
  """Pre-LayerNorm blocks (attention, then a gelu MLP), tied output `x @ embedding.T`.

  `params` in the layout of `attention_to_2d`.
  """
  p = params["params"]
  table = p["Embed_0"]["embedding"]
  x = table[ids] + p["pos"][: ids.shape[1]]
  for i in range(num_layers):
    blk = p[f"Block_{i}"]
    x = x + _attention(
      blk["MultiHeadDotProductAttention_0"], layer_norm(blk["LayerNorm_0"], x), heads
    )
    h = layer_norm(blk["LayerNorm_1"], x) @ blk["Dense_0"]["kernel"] + blk["Dense_0"]["bias"]
    # Parenthesised as in Flax: the bias belongs to the dense output, not to the residual sum.
    x = x + (jax.nn.gelu(h, approximate=True) @ blk["Dense_1"]["kernel"] + blk["Dense_1"]["bias"])
  return layer_norm(p["LayerNorm_0"], x) @ table.T


def apply(config: Mapping[str, Any], params, inputs):
  """The model of `config["model"]` ("autoencoder", "cnn", "transformer") on `inputs`."""
  model = config.get("model", "autoencoder")
  if model == "autoencoder":
    return autoencoder(params, inputs, config["activations"])
  if model == "cnn":
    return cnn(params, inputs, config["num_convs"])
  if model == "transformer":
    return transformer(params, inputs, config["num_layers"], config["heads"])
  raise ValueError(f"config['model'] must be 'autoencoder', 'cnn' or 'transformer', got {model!r}.")
