"""Predictive distributions behind the loss tags: the output-space vectors the estimator backprops.

For a tag with prediction `z` (logits or mean), per-example negative log-likelihood `ℓ(z, y)` and
weight `w`, the per-example loss is `w ℓ`. Its Fisher with respect to `z` is `w F_z`, with
  categorical:     F_z = diag(p) - p pᵀ,      p = softmax(z),    ∇_z ℓ = p - onehot(y)
  multi-Bernoulli: F_z = diag(p (1 - p)),     p = sigmoid(z),    ∇_z ℓ = p - y
  normal(var):     F_z = I / var,                                ∇_z ℓ = (z - y) / var
(for a categorical with extra axes, `[..., T, C]`, F_z is block-diagonal over the positions T).
These are canonical-link losses, so the Hessian of `ℓ` in `z` (the Gauss-Newton factor) is the
same matrix: `H_z ℓ = F_z`, independent of `y`.

Square-root factors `B` with `B Bᵀ = F_z` (per position for the categorical, coordinate-wise
otherwise):
  categorical:     B = diag(√p) - p √pᵀ        (column c is √p_c (e_c - p))
  multi-Bernoulli: B = diag(√(p (1 - p)))
  normal(var):     B = I / √var

Estimation modes. Each builds a stack `v_1 .. v_S` of per-example output vectors (leading axis S,
then the prediction's shape) that the estimator pulls back through the network. The convention,
for every mode, is that the stack is an **average**:

    (1/S) Σ_s v_s v_sᵀ ≈ w F_z     (per example; "≈" is "in expectation" for random modes)

so that the blocks divide their sums over the leading axis by S (e.g. G = Σ_s Σ_rows g gᵀ / (S N)).
  "gradients":          v_s = √w ∇_z ℓ(z, y_s), y_s ~ p(y|z), S = num_samples: the Fisher.
  "empirical":          v = √w ∇_z ℓ(z, y) with the data's y, S = 1: the empirical Fisher,
                        `w ∇ℓ ∇ℓᵀ`, linear in the weight like every mode (a multiplicity; the
                        weighted loss's own gradients `w ∇ℓ` would give `w²`).
  "curvature_prop":     v_s = √w B r_s, r_s Rademacher (±1 per example and output coordinate),
                        S = num_samples: the Fisher, E[r rᵀ] = I (Martens, Sutskever & Swersky
                        2012, "Estimating the Hessian by back-propagating curvature").
  "curvature_prop_GGN": the same with the square-root factor of the loss Hessian (the GGN).
  "exact":              v_k = √K √w B e_k for every non-batch output coordinate k, S = K =
                        prod(z.shape[1:]): (1/K) Σ_k v_k v_kᵀ = w B Bᵀ exactly. `num_samples`
                        does not apply (it must be 1). The stack holds K vectors of the
                        prediction's size, and the estimator runs K backward passes.
  "exact_GGN":          the same with the GGN factor.
Vectors are per example: they are *not* divided by the batch size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kfac_jax._specs import LossSpec

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


def _first_above(cdf: Array, x: Array, mass: Array) -> Array:
  """Per row of `cdf [..., n]`: the first index with `cdf > x` among those with `mass > 0`, or,
  where none is (`x` at the top of the cdf by rounding), the last index with `mass > 0`.

  A class without mass is never picked, whatever the rounding of the cumulative sum.
  """
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
  """Class indices drawn by inverse-CDF sampling from the rows of `p [..., V]` (non-negative,
  any positive total), with two uniforms per draw `u [S, ..., 2]` in [0, 1): `[S, ...]` int32.

  Two levels: the classes in blocks of `categorical_block_width(V)` (the last padded with zeros);
  `u[..., 0]` picks a block from the cumulative block masses, `u[..., 1]` a class from the
  block's own cumulative masses. P(class) = P(block) P(class | block) = p_c / Σ p, and the two
  cumulative sums are of length ~√V, so the work per draw is one pass over `p` (its block
  masses, shared by the S draws) and O(√V) per draw, where a one-level cumulative sum costs
  several passes and the Gumbel-max trick one random variate per class. Each level resolves
  masses down to its uniform's granularity relative to that level's total.
  """
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
  if spec.kind == "normal":
    return z[None] + jnp.sqrt(spec.var).astype(z.dtype) * jax.random.normal(rng, shape, z.dtype)
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


def fisher_sqrt_product(spec: LossSpec, z: Array, r: Array) -> Array:
  """`B r` for the per-example Fisher square-root factor `B` (`B Bᵀ = F_z`), at prediction `z`.

  `r` has `z`'s shape (one vector per example and, for the categorical, per position). Weights
  are not applied here. See the module docstring for `B`.
  """
  if spec.kind == "categorical":
    p = jax.nn.softmax(z, axis=-1)
    sqrt_p = jnp.sqrt(p)
    # (diag(√p) - p √pᵀ) r = √p ⊙ r - p (√p · r), per position.
    return sqrt_p * r - p * jnp.sum(sqrt_p * r, axis=-1, keepdims=True)
  if spec.kind == "bernoulli":
    p = jax.nn.sigmoid(z)
    return jnp.sqrt(p * (1 - p)) * r
  if spec.kind == "normal":
    return r / jnp.sqrt(jnp.asarray(spec.var, z.dtype))
  raise ValueError(f"unknown loss kind {spec.kind!r}")


def ggn_sqrt_product(spec: LossSpec, z: Array, r: Array) -> Array:
  """`C r` for a square-root factor `C` of the loss Hessian in `z` (`C Cᵀ = ∂²ℓ/∂z²`).

  This is the output factor of the generalised Gauss-Newton matrix `Jᵀ H_z J`. It is derived from
  the Hessian rather than from the predictive distribution:
    categorical:     ∂²ℓ/∂z² = diag(p) - p pᵀ = (I - p 1ᵀ) diag(p) (I - 1 pᵀ),
                     so C = (I - p 1ᵀ) diag(√p);
    multi-Bernoulli: ∂²ℓ/∂z² = diag(σ'(z)), σ'(z) = σ(z) σ(-z), so C = diag(√σ'(z));
    normal(var):     ∂²ℓ/∂z² = I / var, so C = I / √var.
  All three losses use the canonical link, so `C` coincides with the Fisher factor of
  `fisher_sqrt_product` (tests/test_losses.py checks both against jax.hessian); the separate
  function is where a non-canonical loss would differ.
  """
  if spec.kind == "categorical":
    p = jax.nn.softmax(z, axis=-1)
    u = jnp.sqrt(p) * r  # diag(√p) r
    return u - p * jnp.sum(u, axis=-1, keepdims=True)  # (I - p 1ᵀ) u
  if spec.kind == "bernoulli":
    return jnp.sqrt(jax.nn.sigmoid(z) * jax.nn.sigmoid(-z)) * r
  if spec.kind == "normal":
    return r * jax.lax.rsqrt(jnp.asarray(spec.var, z.dtype))
  raise ValueError(f"unknown loss kind {spec.kind!r}")


RANDOM_MODES = ("gradients", "curvature_prop", "curvature_prop_GGN")
EXACT_MODES = ("exact", "exact_GGN")
SQRT_PRODUCTS = {
  "curvature_prop": fisher_sqrt_product,
  "curvature_prop_GGN": ggn_sqrt_product,
  "exact": fisher_sqrt_product,
  "exact_GGN": ggn_sqrt_product,
}


def _exact_columns(spec: LossSpec, z: Array, sqrt_product) -> Array:
  """`[K, *z.shape]`: the columns `B e_k` over all K non-batch coordinates, for every example."""
  event = z.shape[1:]
  k = math.prod(event)
  basis = jnp.eye(k, dtype=z.dtype).reshape((k, 1) + event)  # e_k, the same for every example.
  basis = jnp.broadcast_to(basis, (k,) + z.shape)
  return jax.vmap(lambda e: sqrt_product(spec, z, e))(basis)


def output_cotangents(
  spec: LossSpec, operands: tuple[Array, ...], mode: str, rng: Array | None, num_samples: int
) -> Array:
  """The stack `[S, *z.shape]` of per-example output vectors for `mode` (module docstring).

  `(1/S) Σ_s v_s v_sᵀ` is (in expectation, or exactly for the exact modes) `w F_z` per example.
  Computed in float32 (or float64 with x64) and returned in the prediction's dtype.

  Raises:
    ValueError: "empirical" for a tag registered without targets; a random mode (RANDOM_MODES)
      without `rng`.
  """
  z = operands[0]
  targets = operands[1] if spec.has_targets else None
  weight = operands[1 + spec.has_targets] if spec.has_weight else None
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  if mode in RANDOM_MODES and rng is None:
    raise ValueError(f"estimation_mode={mode!r} draws random vectors: pass `rng`.")
  if mode == "empirical":
    if targets is None:
      raise ValueError(
        f"estimation_mode='empirical' needs the data's targets, but the {spec.kind} loss tag "
        "was registered without them: pass `targets` to the register_*_loss call."
      )
    y = targets if jnp.issubdtype(targets.dtype, jnp.integer) else targets.astype(zf.dtype)
    vec = _grad_nll(spec, zf, y)[None]
  elif mode == "gradients":
    assert rng is not None  # RANDOM_MODES checked above.
    y = _sample(spec, zf, rng, num_samples)
    vec = jax.vmap(lambda yy: _grad_nll(spec, zf, yy))(y)
  elif mode in ("curvature_prop", "curvature_prop_GGN"):
    assert rng is not None  # RANDOM_MODES checked above.
    r = jax.random.rademacher(rng, (num_samples,) + zf.shape, zf.dtype)
    vec = jax.vmap(lambda rr: SQRT_PRODUCTS[mode](spec, zf, rr))(r)
  elif mode in EXACT_MODES:
    cols = _exact_columns(spec, zf, SQRT_PRODUCTS[mode])
    vec = cols * jnp.sqrt(jnp.asarray(cols.shape[0], zf.dtype))  # Average over K, not sum.
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


def output_gradient(spec: LossSpec, operands: tuple[Array, ...]) -> Array:
  """∇_z of the tagged loss `(1/N) Σₙ wₙ ℓ(zₙ, yₙ)` with the tag's targets: `(1/N) w ∇_z ℓ`.

  The loss audit compares it with the gradient of the loss `loss_fn` returns. Needs a tag
  registered with targets.
  """
  z = operands[0]
  if not spec.has_targets:
    raise ValueError(f"the {spec.kind} loss tag has no targets: its gradient is not defined.")
  targets = operands[1]
  weight = operands[2] if spec.has_weight else None
  zf = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  y = targets if jnp.issubdtype(targets.dtype, jnp.integer) else targets.astype(zf.dtype)
  out = _grad_nll(spec, zf, y) * _weight(spec, weight, zf) / spec.batch_size
  return out.astype(z.dtype)
