"""Predictive distributions behind the loss tags: the output-space vectors the estimator backprops.

For a tag with prediction `z` (logits or mean), per-example negative log-likelihood `ℓ(z, y)` and
weight `w`, the per-example loss is `w ℓ`. Its Fisher with respect to `z` is `w F_z`, with
  categorical:     F_z = diag(p) - p pᵀ,      p = softmax(z),    ∇_z ℓ = p - onehot(y)
  multi-Bernoulli: F_z = diag(p (1 - p)),     p = sigmoid(z),    ∇_z ℓ = p - y
  normal(var):     F_z = I / var,                                ∇_z ℓ = (z - y) / var
Backpropagating `√w ∇_z ℓ(z, y)` with `y` drawn from the model gives a vector whose outer product
is, in expectation, this Fisher ("gradients" mode); with the data's `y` it gives the empirical
Fisher ("empirical" mode). Vectors are per example: they are *not* divided by the batch size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax._scanner import LossSpec

Array = jax.Array


def _grad_nll(spec: LossSpec, z: Array, y: Array) -> Array:
  if spec.kind == "categorical":
    p = jax.nn.softmax(z, axis=-1)
    if y.shape == z.shape[:-1]:
      y = jax.nn.one_hot(y, z.shape[-1], dtype=z.dtype)
    return p - y
  if spec.kind == "bernoulli":
    return jax.nn.sigmoid(z) - y
  if spec.kind == "normal":
    return (z - y) / spec.var
  raise ValueError(f"unknown loss kind {spec.kind!r}")


def _sample(spec: LossSpec, z: Array, rng: Array, num_samples: int) -> Array:
  shape = (num_samples,) + z.shape
  zs = jnp.broadcast_to(z[None], shape)
  if spec.kind == "categorical":
    labels = jax.random.categorical(rng, zs, axis=-1)
    return jax.nn.one_hot(labels, z.shape[-1], dtype=z.dtype)
  if spec.kind == "bernoulli":
    return jax.random.bernoulli(rng, jax.nn.sigmoid(zs)).astype(z.dtype)
  if spec.kind == "normal":
    return zs + jnp.sqrt(spec.var).astype(z.dtype) * jax.random.normal(rng, shape, z.dtype)
  raise ValueError(f"unknown loss kind {spec.kind!r}")


def _sqrt_weight(spec: LossSpec, weight: Array | None, z: Array) -> Array | float:
  """√w with a leading sample axis, broadcastable to `[samples, *z.shape]` at equal rank."""
  if weight is None:
    return 1.0
  w = jnp.sqrt(jnp.maximum(weight.astype(z.dtype), 0.0))
  if spec.kind == "categorical":
    w = jnp.broadcast_to(w, z.shape[:-1])[..., None]
  else:
    w = jnp.broadcast_to(w, z.shape)
  return w[None]


def output_cotangents(spec: LossSpec, operands: tuple[Array, ...], mode: str, rng: Array | None,
                      num_samples: int) -> Array:
  """Per-example vectors `√w ∇_z ℓ`, with a leading axis of `num_samples` (1 for empirical).

  Computed in float32 (or float64 with x64) and returned in the prediction's dtype.
  """
  z = operands[0]
  targets = operands[1] if spec.has_targets else None
  weight = operands[1 + spec.has_targets] if spec.has_weight else None
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  if mode == "empirical":
    if targets is None:
      raise ValueError(
          f"estimation_mode='empirical' needs the data's targets, but the {spec.kind} loss tag "
          "was registered without them: pass `targets` to the register_*_loss call.")
    y = targets if jnp.issubdtype(targets.dtype, jnp.integer) else targets.astype(zf.dtype)
    vec = _grad_nll(spec, zf, y)[None]
  elif mode == "gradients":
    y = _sample(spec, zf, rng, num_samples)
    vec = jax.vmap(lambda yy: _grad_nll(spec, zf, yy))(y)
  else:
    raise ValueError(f"unsupported estimation mode {mode!r}")
  vec = vec * _sqrt_weight(spec, weight, zf)
  return vec.astype(z.dtype)


def _weight(spec: LossSpec, weight: Array | None, z: Array) -> Array | float:
  """w broadcastable to `z.shape` at equal rank (1 when there is no weight)."""
  if weight is None:
    return 1.0
  w = jnp.maximum(weight.astype(z.dtype), 0.0)
  if spec.kind == "categorical":
    return jnp.broadcast_to(w, z.shape[:-1])[..., None]
  return jnp.broadcast_to(w, z.shape)


def output_curvature_product(spec: LossSpec, operands: tuple[Array, ...], v: Array) -> Array:
  """H_z v: the Hessian of the tagged loss with respect to its prediction `z`, times `v`.

  The tagged loss is `(1/N) Σₙ wₙ ℓ(zₙ, yₙ)`; for these canonical-link losses its Hessian in `z`
  does not depend on the targets and equals the Fisher, so `H_z = (1/N) w F_z` per example with
  `F_z` from the module docstring. This is the output-space factor of the Gauss-Newton matrix
  `Jᵀ H_z J` (the quadratic model of the optimizer). `v` has the prediction's shape.
  """
  z = operands[0]
  weight = operands[1 + spec.has_targets] if spec.has_weight else None
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  vf = v.astype(zf.dtype)
  if spec.kind == "categorical":
    p = jax.nn.softmax(zf, axis=-1)
    out = p * vf - p * jnp.sum(p * vf, axis=-1, keepdims=True)
  elif spec.kind == "bernoulli":
    p = jax.nn.sigmoid(zf)
    out = p * (1 - p) * vf
  elif spec.kind == "normal":
    out = vf / spec.var
  else:
    raise ValueError(f"unknown loss kind {spec.kind!r}")
  out = out * _weight(spec, weight, zf) / spec.batch_size
  return out.astype(v.dtype)
