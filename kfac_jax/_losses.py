"""Predictive distributions behind the loss tags: the output-space vectors the estimator backprops.

For a tag with prediction `z`, per-example negative log-likelihood `ℓ(z, y)` and weight `w`, the
per-example loss `w ℓ` has the Fisher `w F_z` in `z` (also its Hessian: the losses have canonical
links), with one square-root factor `B` (`B Bᵀ = F_z`) serving the Fisher and the GGN modes:
  categorical:     F_z = diag(p) - p pᵀ,   p = softmax(z),   B = diag(√p) - p √pᵀ
  multi-Bernoulli: F_z = diag(p (1 - p)),  p = sigmoid(z),   B = diag(√(p (1 - p)))
  normal(var):     F_z = I / var,                            B = I / √var
(block-diagonal over the positions of a categorical `[..., T, C]`).

Each estimation mode builds a stack `v_1 .. v_S` of per-example output vectors (leading axis S,
not divided by the batch size) whose **average** `(1/S) Σ_s v_s v_sᵀ` is `w F_z` (in expectation
for the random modes; docs/approximations.rst): `√w ∇_z ℓ(z, y_s)` with `y_s ~ p(y|z)`
("gradients"), `√w ∇_z ℓ(z, y)` with the data's `y` ("empirical": `w ∇ℓ ∇ℓᵀ`, not the `w²` of
the weighted loss's own gradients), `√w B r_s` with Rademacher `r_s` ("curvature_prop"), or
`√K √w B e_k` for every non-batch coordinate k, K of them ("exact": K backward passes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kfac_jax._specs import LossSpec

Array = jax.Array
RANDOM_MODES = ("gradients", "curvature_prop", "curvature_prop_GGN")
EXACT_MODES = ("exact", "exact_GGN")


def _grad_nll(spec: LossSpec, z: Array, y: Array) -> Array:
  if spec.kind == "categorical":
    if y.shape == z.shape[:-1]:
      y = jax.nn.one_hot(y, z.shape[-1], dtype=z.dtype)
    return jax.nn.softmax(z, axis=-1) - y
  if spec.kind == "bernoulli":
    return jax.nn.sigmoid(z) - y
  return (z - y) / spec.var


def _first_above(cdf: Array, x: Array, mass: Array) -> Array:
  """Per row of `cdf [..., n]`: the first index with `cdf > x` among those with `mass > 0`, or,
  where none is (`x` at the top of the cdf by rounding), the last index with `mass > 0`."""
  n = cdf.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  live = mass > 0
  first = jnp.min(jnp.where(live & (cdf > x[..., None]), idx, n), axis=-1)
  last = jnp.max(jnp.where(live, idx, -1), axis=-1)
  return jnp.clip(jnp.where(first < n, first, last), 0, n - 1)


def categorical_block_width(num_classes: int) -> int:
  """The block width of `categorical_inverse_cdf`: the power of two at or above √V."""
  return 1 << max(0, math.ceil(math.log2(max(num_classes, 1)) / 2))


def categorical_inverse_cdf(p: Array, u: Array) -> Array:
  """Class indices `[S, ...]` drawn by inverse-CDF sampling from the rows of `p [..., V]`
  (non-negative, any positive total) with two uniforms per draw `u [S, ..., 2]` in [0, 1):
  `u[..., 0]` picks a block of `categorical_block_width(V)` classes, `u[..., 1]` a class in it,
  so P(class) = p_c / Σ p and each draw costs O(√V)."""
  v = p.shape[-1]
  width = categorical_block_width(v)
  blocks = -(-v // width)
  pad = [(0, 0)] * (p.ndim - 1) + [(0, blocks * width - v)]
  pb = jnp.pad(p, pad).reshape(p.shape[:-1] + (blocks, width))[None]  # [1, ..., blocks, width]
  mass = jnp.sum(pb, axis=-1)  # [1, ..., blocks]
  cdf = jnp.cumsum(mass, axis=-1)
  j = _first_above(cdf, u[..., 0] * cdf[..., -1], mass)  # [S, ...]
  pbs = jnp.broadcast_to(pb, j.shape + pb.shape[-2:])
  block = jnp.take_along_axis(pbs, j[..., None, None], axis=-2)[..., 0, :]  # [S, ..., width]
  cdf_in = jnp.cumsum(block, axis=-1)
  k = _first_above(cdf_in, u[..., 1] * cdf_in[..., -1], block)
  return j * width + k


def _sample(spec: LossSpec, z: Array, rng: Array, num_samples: int) -> Array:
  """`[S, *z.shape]` targets drawn from the predictive distribution at `z`."""
  shape = (num_samples,) + z.shape
  if spec.kind == "categorical":
    u = jax.random.uniform(rng, (num_samples,) + z.shape[:-1] + (2,), z.dtype)
    labels = categorical_inverse_cdf(jax.nn.softmax(z, axis=-1), u)
    return jax.nn.one_hot(labels, z.shape[-1], dtype=z.dtype)
  if spec.kind == "bernoulli":
    return jax.random.bernoulli(rng, jax.nn.sigmoid(z)[None], shape).astype(z.dtype)
  return z[None] + jnp.sqrt(spec.var).astype(z.dtype) * jax.random.normal(rng, shape, z.dtype)


def _weight(spec: LossSpec, operands: tuple[Array, ...], z: Array) -> Array | float:
  """w (negative entries as 0) broadcastable to `z.shape` at equal rank; 1 without a weight."""
  if not spec.has_weight:
    return 1.0
  w = jnp.maximum(operands[-1].astype(z.dtype), 0.0)
  if spec.kind == "categorical":
    return jnp.broadcast_to(w, z.shape[:-1])[..., None]
  return jnp.broadcast_to(w, z.shape)


def _as_targets(targets: Array, z: Array) -> Array:
  return targets if jnp.issubdtype(targets.dtype, jnp.integer) else targets.astype(z.dtype)


def fisher_sqrt_product(spec: LossSpec, z: Array, r: Array) -> Array:
  """`B r` for the per-example square-root factor `B` (`B Bᵀ = F_z = ∂²ℓ/∂z²`, module
  docstring) at prediction `z`; `r` has `z`'s shape. Weights are not applied here."""
  if spec.kind == "categorical":
    p = jax.nn.softmax(z, axis=-1)
    sqrt_p = jnp.sqrt(p)
    # (diag(√p) - p √pᵀ) r = √p ⊙ r - p (√p · r), per position.
    return sqrt_p * r - p * jnp.sum(sqrt_p * r, axis=-1, keepdims=True)
  if spec.kind == "bernoulli":
    p = jax.nn.sigmoid(z)
    return jnp.sqrt(p * (1 - p)) * r
  return r / jnp.sqrt(jnp.asarray(spec.var, z.dtype))


def whitened_residual(spec: LossSpec, operands: tuple[Array, ...]) -> Array:
  """`√w ⊙ e` with `B e = ∇_z ℓ(z, y)` for the square-root factor `B` of `fisher_sqrt_product`
  (`e` orthogonal to B's null space), at the tag's targets, in z's shape and float32 or wider:
    categorical:     e = (p - y) / √p,   multi-Bernoulli: e = (p - y) / √(p (1 - p)),
    normal(var):     e = (z - y) / √var,
  0 where `p` or `p (1 - p)` has underflowed to 0. With the exact modes' vectors `B e_k`, it
  gives the tagged loss's per-example gradient `w ∇_z ℓ = Σ_k (√w ⊙ B e_k) e_k`."""
  z = operands[0]
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  y = _as_targets(operands[1], zf)
  if spec.kind == "normal":
    e = (zf - y) / jnp.sqrt(jnp.asarray(spec.var, zf.dtype))
  else:
    p = jax.nn.softmax(zf, axis=-1) if spec.kind == "categorical" else jax.nn.sigmoid(zf)
    s = p if spec.kind == "categorical" else p * (1 - p)
    live = s > 0
    e = jnp.where(live, _grad_nll(spec, zf, y) / jnp.sqrt(jnp.where(live, s, 1)), 0)
  if spec.has_weight:
    e = e * jnp.sqrt(_weight(spec, operands, zf))
  return e


def output_cotangents(
  spec: LossSpec, operands: tuple[Array, ...], mode: str, rng: Array | None, num_samples: int
) -> Array:
  """The stack `[S, *z.shape]` of per-example output vectors for `mode` (module docstring), in
  the prediction's dtype; a ValueError for "empirical" on a tag without targets."""
  z = operands[0]
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  if mode == "empirical":
    if not spec.has_targets:
      raise ValueError(
        f"estimation_mode='empirical' needs the data's targets, but the {spec.kind} loss tag "
        "was registered without them: pass `targets` to the register_*_loss call."
      )
    vec = _grad_nll(spec, zf, _as_targets(operands[1], zf))[None]
  elif mode == "gradients":
    assert rng is not None  # `check_rng` ran.
    y = _sample(spec, zf, rng, num_samples)
    vec = jax.vmap(lambda yy: _grad_nll(spec, zf, yy))(y)
  elif mode in EXACT_MODES:  # The columns B e_k over all K non-batch coordinates, times √K.
    k = math.prod(zf.shape[1:])
    basis = jnp.eye(k, dtype=zf.dtype).reshape((k, 1) + zf.shape[1:])
    basis = jnp.broadcast_to(basis, (k,) + zf.shape)
    vec = jax.vmap(lambda e: fisher_sqrt_product(spec, zf, e))(basis)
    vec = vec * jnp.sqrt(jnp.asarray(k, zf.dtype))
  else:  # "curvature_prop" and "curvature_prop_GGN"
    assert rng is not None  # `check_rng` ran.
    r = jax.random.rademacher(rng, (num_samples,) + zf.shape, zf.dtype)
    vec = jax.vmap(lambda rr: fisher_sqrt_product(spec, zf, rr))(r)
  if spec.has_weight:
    vec = vec * jnp.sqrt(_weight(spec, operands, zf))[None]
  return vec.astype(z.dtype)


def output_curvature_product(spec: LossSpec, operands: tuple[Array, ...], v: Array) -> Array:
  """H_z v: the Hessian of the tagged loss `(1/N) Σₙ wₙ ℓ(zₙ, yₙ)` in its prediction `z`, times
  `v` (`z`'s shape): `(1/N) w F_z v` per example, the output factor of the Gauss-Newton matrix
  `Jᵀ H_z J` (the optimizer's quadratic model)."""
  z = operands[0]
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  vf = v.astype(zf.dtype)
  if spec.kind == "categorical":
    p = jax.nn.softmax(zf, axis=-1)
    out = p * vf - p * jnp.sum(p * vf, axis=-1, keepdims=True)
  elif spec.kind == "bernoulli":
    p = jax.nn.sigmoid(zf)
    out = p * (1 - p) * vf
  else:
    out = vf / spec.var
  out = out * _weight(spec, operands, zf) / spec.batch_size
  return out.astype(v.dtype)


def output_gradient(spec: LossSpec, operands: tuple[Array, ...]) -> Array:
  """∇_z of the tagged loss with the tag's targets (a tag registered with them):
  `(1/N) w ∇_z ℓ`, which the loss audit compares with the returned loss's gradient."""
  z = operands[0]
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  out = _grad_nll(spec, zf, _as_targets(operands[1], zf)) * _weight(spec, operands, zf)
  return (out / spec.batch_size).astype(z.dtype)
