"""Kronecker-factored block for dense layers (K-FAC, Martens & Grosse 2015).

A dense layer `s = x W (+ b)` with kernel viewed as a matrix `W: [in, out]` (Flax layout; other
layouts are transposed/reshaped into it, see `DenseInfo`) and the bias appended as a last row,
`M = [W; b]: [in+1, out]`. With ā = [x, 1] per row (a row is one example, or one position of an
example for sequence inputs) and g = ∂(per-example loss)/∂s,

    F ≈ A ⊗ G,   A = (1/R) Σ_r ā_r ā_rᵀ,   G = (1/N) Σ_r g_r g_rᵀ

over R rows and N examples (R = N for a plain MLP, giving the usual E[āāᵀ] ⊗ E[ggᵀ]). Vectors
are matrices M; with row-major vec, (A ⊗ G) vec(M) = vec(A M G).

Damping ("factored"): A_λ = A + π√λ I, G_λ = G + (√λ/π) I, π = sqrt((tr A/dim A)/(tr G/dim G)),
and the block multiplies by A_λ^p ⊗ G_λ^p. ("eigen"): exact (A ⊗ G + λ I)^p through the factors'
eigen-decompositions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _scanner
from kfac_jax.blocks import _linalg
from kfac_jax.blocks._base import Block

Array = jax.Array


class KroneckerDenseBlock(Block):
  """K-FAC block of a dense layer (kernel, optional bias)."""

  # -- layout ----------------------------------------------------------------------------------

  @property
  def _info(self) -> _scanner.DenseInfo:
    return self.spec.dense

  def _kernel_operand_shape(self) -> tuple[int, ...]:
    chain = self._info.kernel_view
    return chain[-1].out_shape if chain else self.spec.param_shapes[0]

  def _to_matrix(self, vecs) -> Array:
    info = self._info
    k = _scanner.apply_view(info.kernel_view, vecs[0].astype(self.config.dtype))
    m = k.transpose(info.kernel_perm).reshape(info.in_dim, info.out_dim)
    if self.spec.has_bias:
      m = jnp.concatenate([m, vecs[1].astype(self.config.dtype).reshape(1, info.out_dim)])
    return m

  def _from_matrix(self, m: Array, like) -> list[Array]:
    info = self._info
    op_shape = self._kernel_operand_shape()
    permuted = tuple(op_shape[d] for d in info.kernel_perm)
    k = m[:info.in_dim].reshape(permuted).transpose(np.argsort(info.kernel_perm))
    out = [_scanner.undo_view(info.kernel_view, k).reshape(like[0].shape).astype(like[0].dtype)]
    if self.spec.has_bias:
      out.append(m[info.in_dim].reshape(like[1].shape).astype(like[1].dtype))
    return out

  # -- statistics ------------------------------------------------------------------------------

  def init_factors(self):
    (da, _), (dg, _) = self.spec.factor_shapes
    return {"a": jnp.zeros((da, da), self.config.dtype), "g": jnp.zeros((dg, dg), self.config.dtype)}

  def batch_factors(self, data, batch_size):
    x, g = data  # x: [rows, in]; g: [samples, rows, out]
    x = x.astype(self.config.dtype)
    g = g.astype(self.config.dtype)
    rows = x.shape[0]
    if self.spec.has_bias:
      x = jnp.concatenate([x, jnp.ones((rows, 1), x.dtype)], axis=1)
    a = x.T @ x / rows
    g2 = g.reshape(-1, g.shape[-1])
    gg = g2.T @ g2 / (g.shape[0] * batch_size)
    return {"a": a, "g": gg}

  # -- inverses --------------------------------------------------------------------------------

  def _damped_factors(self, factors, damping):
    a, g = factors["a"], factors["g"]
    pi = _linalg.pi_adjustment(a, g)
    root = jnp.sqrt(damping)
    a_d = a + (pi * root) * jnp.eye(a.shape[0], dtype=a.dtype)
    g_d = g + (root / pi) * jnp.eye(g.shape[0], dtype=g.dtype)
    return a_d, g_d

  def _cache_keys(self):
    if self.config.damping_mode == "eigen":
      return ["a_evecs", "g_evecs"], ["a_evals", "g_evals"]
    mats = []
    for e in self.config.exps:
      if e != 1:
        mats += [f"a_pow{e:g}", f"g_pow{e:g}"]
    if self.config.cholesky:
      mats += ["a_chol", "g_chol"]
    if self.config.cholesky_inverse:
      mats += ["a_chol_inv", "g_chol_inv"]
    return mats, []

  def init_cache(self):
    (da, _), (dg, _) = self.spec.factor_shapes
    mats, vecs = self._cache_keys()
    dims = {"a": da, "g": dg}
    cache = {k: jnp.eye(dims[k[0]], dtype=self.config.dtype) for k in mats}
    cache.update({k: jnp.ones((dims[k[0]],), self.config.dtype) for k in vecs})
    cache["damping"] = jnp.zeros((), self.config.dtype)
    return cache

  def compute_cache(self, factors, damping):
    damping = jnp.asarray(damping, self.config.dtype)
    cache = {"damping": damping}
    if self.config.damping_mode == "eigen":
      for f in ("a", "g"):
        s, u = _linalg.eigh_psd(factors[f])
        cache[f"{f}_evals"], cache[f"{f}_evecs"] = s, u
      return cache
    a_d, g_d = self._damped_factors(factors, damping)
    for e in self.config.exps:
      if e != 1:
        cache[f"a_pow{e:g}"] = _linalg.spd_power(a_d, e)
        cache[f"g_pow{e:g}"] = _linalg.spd_power(g_d, e)
    if self.config.cholesky or self.config.cholesky_inverse:
      for f, m in (("a", a_d), ("g", g_d)):
        chol = _linalg.cholesky(m)
        if self.config.cholesky:
          cache[f"{f}_chol"] = chol
        if self.config.cholesky_inverse:
          cache[f"{f}_chol_inv"] = _linalg.lower_inverse(chol)
    return cache

  # -- products --------------------------------------------------------------------------------

  def _eigen_scaled(self, cache, m, fn):
    ua, ug = cache["a_evecs"], cache["g_evecs"]
    sigma = cache["a_evals"][:, None] * cache["g_evals"][None, :] + cache["damping"]
    return ua @ ((ua.T @ m @ ug) * fn(sigma)) @ ug.T

  def multiply_matpower(self, factors, cache, vecs, exp):
    self.check_exp(exp)
    m = self._to_matrix(vecs)
    if exp == 1:
      if self.config.damping_mode == "eigen":
        out = factors["a"] @ m @ factors["g"] + cache["damping"] * m
      else:
        a_d, g_d = self._damped_factors(factors, cache["damping"])
        out = a_d @ m @ g_d
    elif self.config.damping_mode == "eigen":
      out = self._eigen_scaled(cache, m, lambda s: s ** exp)
    else:
      out = cache[f"a_pow{exp:g}"] @ m @ cache[f"g_pow{exp:g}"]
    return self._from_matrix(out, vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    m = self._to_matrix(vecs)
    if self.config.damping_mode == "eigen":
      # The symmetric square root: C = Cᵀ = (A ⊗ G + λ I)^½.
      out = self._eigen_scaled(cache, m, (lambda s: s ** -0.5) if inverse else jnp.sqrt)
      return self._from_matrix(out, vecs)
    key = "chol_inv" if inverse else "chol"
    if f"a_{key}" not in cache:
      raise ValueError(
          f"block `{self.name}`: Cholesky{' inverse' if inverse else ''} products need "
          f"compute_cholesky{'_inverse' if inverse else ''}=True in the estimator.")
    la, lg = cache[f"a_{key}"], cache[f"g_{key}"]
    # C = La ⊗ Lg acts as M ↦ La M Lgᵀ; Cᵀ as M ↦ Laᵀ M Lg.
    out = la.T @ m @ lg if transpose else la @ m @ lg.T
    return self._from_matrix(out, vecs)

  def multiply_undamped(self, factors, vecs):
    m = self._to_matrix(vecs)
    return self._from_matrix(factors["a"] @ m @ factors["g"], vecs)

