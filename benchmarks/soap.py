"""SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"), a race
contestant written from the paper's algorithm: Adam run in the eigenbasis of Shampoo's two
Kronecker factors.

For a matrix parameter W (m × n; a leaf of more dimensions is treated as the matrix of its
leading dimensions flattened against its last one, as a conv kernel `[h, w, c_in, c_out]`), with
gradient G at step t:

    L ← β_s L + (1 − β_s) G Gᵀ            R ← β_s R + (1 − β_s) Gᵀ G         (Shampoo's factors)
    Q_L, Q_R = eigenvectors of L and R    (on steps 1, 1 + f, 1 + 2f, …; f = precondition_every)
    (step 1 stops here, with a zero update: see below)
    M ← β₁ M + (1 − β₁) G                 (first moment, in the parameter's own basis)
    G' = Q_Lᵀ G Q_R,  M' = Q_Lᵀ M Q_R      (rotated into the eigenbasis)
    V ← β₂ V + (1 − β₂) G'²               (second moment, in the eigenbasis)
    N' = (M' / (1 − β₁ᵏ)) / (√(V / (1 − β₂ᵏ)) + ε),   k = t − 1
    update = −lr · Q_L N' Q_Rᵀ

The first gradient only builds L, R and the first bases, and the update is zero; the moments
start with the second (k counts their steps), as in the paper's implementation. In the bases of
one gradient's own L and R that gradient is diagonal (its singular values), and Adam's
normalisation would turn the round-off in the other entries into steps of full size.

A side longer than `max_precond_dim` keeps the identity as its basis (no factor), and a leaf
with fewer than two dimensions (biases, norm scales) is plain Adam with the same β₁, β₂, ε
(from the second gradient on, too), as in the paper. The bases are refreshed with an exact
`eigh` (the paper's power iteration with a QR step is a cheaper approximation of it); V is kept
across a refresh, as the paper's simplest variant does. Defaults are the paper's: lr 3e-3,
β₁ = β₂ = β_s = 0.95, ε 1e-8, bases every 10 steps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class SoapLeafState(NamedTuple):
  mu: jax.Array  # [m, n] (`_matrix_shape`): first moment, in the parameter's own basis
  nu: jax.Array  # [m, n]: second moment, in the eigenbasis
  left: jax.Array  # [m, m] (or [0, 0] without a factor): L
  right: jax.Array  # [n, n] (or [0, 0]): R
  q_left: jax.Array  # like `left`: eigenvectors of L
  q_right: jax.Array  # like `right`: eigenvectors of R


class SoapState(NamedTuple):
  count: jax.Array  # [] int32: steps taken
  leaves: list  # one SoapLeafState per parameter leaf


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """The matrix a leaf is treated as: leading dimensions against the last, or one row for a
  vector or scalar (which gets no factors: plain Adam)."""
  if len(shape) < 2:
    return 1, math.prod(shape)
  return math.prod(shape[:-1]), shape[-1]


def _eigvecs(factor: jax.Array) -> jax.Array:
  if factor.shape[0] == 0:
    return factor
  return jnp.linalg.eigh(0.5 * (factor + factor.T))[1]


def scale_by_soap(
  b1: float = 0.95,
  b2: float = 0.95,
  shampoo_b: float | None = None,
  eps: float = 1e-8,
  precondition_every: int = 10,
  max_precond_dim: int = 10_000,
) -> optax.GradientTransformation:
  """The SOAP direction `Q_L N' Q_Rᵀ` (module docstring); chain a learning rate after it.

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment (in the eigenbasis).
    shampoo_b: decay of Shampoo's factors L, R (default: `b2`).
    eps: added to the root of the second moment.
    precondition_every: f, the steps between refreshes of the bases: on steps 1, 1 + f, …,
      from the factors that include that step's gradient.
    max_precond_dim: a side longer than this keeps the identity basis.
  """
  if precondition_every < 1:
    raise ValueError(f"precondition_every must be >= 1, got {precondition_every}")
  bs = b2 if shampoo_b is None else shampoo_b

  def init(params):
    def leaf(p):
      m, n = _matrix_shape(p.shape)
      lm = m if p.ndim >= 2 and m <= max_precond_dim else 0
      rn = n if p.ndim >= 2 and n <= max_precond_dim else 0
      return SoapLeafState(  # Fresh arrays for every field: a donated state shares no buffer.
        jnp.zeros((m, n), p.dtype),
        jnp.zeros((m, n), p.dtype),
        jnp.zeros((lm, lm), p.dtype),
        jnp.zeros((rn, rn), p.dtype),
        jnp.eye(lm, dtype=p.dtype),
        jnp.eye(rn, dtype=p.dtype),
      )

    return SoapState(jnp.zeros([], jnp.int32), [leaf(p) for p in jax.tree.leaves(params)])

  def update(updates, state, params=None):
    del params
    grads, treedef = jax.tree.flatten(updates)
    t = state.count + 1
    first = t == 1  # The first gradient only builds the factors and the bases.
    k = jnp.maximum(t - 1, 1)  # The moments' step count (for the bias corrections).
    refresh = (t - 1) % precondition_every == 0
    out, new = [], []
    for g, s in zip(grads, state.leaves):
      c1 = 1 - b1 ** k.astype(g.dtype)
      c2 = 1 - b2 ** k.astype(g.dtype)
      gm = g.reshape(_matrix_shape(g.shape))
      left, right = s.left, s.right
      if left.shape[0]:
        left = bs * left + (1 - bs) * gm @ gm.T
      if right.shape[0]:
        right = bs * right + (1 - bs) * gm.T @ gm
      q_left, q_right = jax.lax.cond(
        refresh,
        lambda ll=left, rr=right: (_eigvecs(ll), _eigvecs(rr)),
        lambda ql=s.q_left, qr=s.q_right: (ql, qr),
      )

      def rotate(x, ql=q_left, qr=q_right):
        if ql.shape[0]:
          x = ql.T @ x
        if qr.shape[0]:
          x = x @ qr
        return x

      def unrotate(x, ql=q_left, qr=q_right):
        if ql.shape[0]:
          x = ql @ x
        if qr.shape[0]:
          x = x @ qr.T
        return x

      mu = b1 * s.mu + (1 - b1) * gm
      nu = b2 * s.nu + (1 - b2) * jnp.square(rotate(gm))
      direction = unrotate((rotate(mu) / c1) / (jnp.sqrt(nu / c2) + eps))
      out.append(jnp.where(first, 0.0, direction).reshape(g.shape))
      mu, nu = jnp.where(first, s.mu, mu), jnp.where(first, s.nu, nu)
      new.append(SoapLeafState(mu, nu, left, right, q_left, q_right))
    return jax.tree.unflatten(treedef, out), SoapState(t, new)

  return optax.GradientTransformation(init, update)


def soap(learning_rate: float, **kwargs) -> optax.GradientTransformation:
  """SOAP with a learning rate: `scale_by_soap(**kwargs)` then `−learning_rate`."""
  return optax.chain(scale_by_soap(**kwargs), optax.scale_by_learning_rate(learning_rate))
