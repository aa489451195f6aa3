"""The damped natural-gradient direction from the rows: in sample space or in parameter space.

Both factorise their Gram matrix by a symmetric eigendecomposition, which gives the
pseudo-inverse of a singular kernel, `(· + λI)⁻¹` for any damping and the info's spectrum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from kfac_jax import _compat
from kfac_jax.kernel._rows import AxisName, Rows, axis_size

Array = jax.Array
_HIGHEST = jax.lax.Precision.HIGHEST
# A remainder within `_ROUNDING` eps of g's scale is rounding error, dropped (package docstring).
_ROUNDING = 1000.0


def _dot(a: Array, b: Array, dtype=None) -> Array:
  """`a @ b` at full precision (small damping's accuracy rests on it), accumulated in `dtype`."""
  return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=dtype)


class _Sharded:
  """Products with U, its rows split over `axis_name` (this device's: `u`), the same on each."""

  def __init__(self, u: Array, axis_name: AxisName, dtype):
    self.u, self.axis, self.dtype = u, axis_name, dtype
    self.devices = axis_size(axis_name)

  def gather(self, x: Array) -> Array:
    """This device's `[R_d, ...]` entries → the `[R, ...]` of every device."""
    return x if self.axis is None else jax.lax.all_gather(x, self.axis, tiled=True)

  def times(self, v: Array) -> Array:
    """U v, `[P, k]` → `[R, k]`."""
    return self.gather(_dot(self.u, v.astype(self.u.dtype), self.dtype))

  def transpose_times(self, y: Array) -> Array:
    """Uᵀ y, `[R, k]` → `[P, k]`: this device's entries of y times its rows, summed."""
    if self.axis is not None:
      r = self.u.shape[0]
      y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(self.axis) * r, r)
    out = _dot(y.astype(self.u.dtype).T, self.u, self.dtype).T
    return out if self.axis is None else jax.lax.psum(out, self.axis)

  def kernel(self) -> Array:
    """K = U Uᵀ `[R, R]` without gathering U: the row blocks go round a ring of `ppermute` calls,
    each device computes its `[R_d, R]` rows of K, and those are gathered."""
    u, dtype = self.u, self.dtype
    own = _dot(u, u.T, dtype)
    d = self.devices
    if d == 1:
      return own
    perm = [(j, (j - 1) % d) for j in range(d)]  # Each device receives its successor's block.

    def step(block, _):
      block = jax.lax.ppermute(block, self.axis, perm)
      return block, _dot(u, block.T, dtype)

    _, rest = jax.lax.scan(step, u, None, length=d - 1)
    blocks = jnp.concatenate([own[None], rest])  # [t]: the columns of device (i + t) mod d.
    blocks = jnp.roll(blocks, jax.lax.axis_index(self.axis), axis=0)
    r = u.shape[0]
    return self.gather(jnp.moveaxis(blocks, 0, 1).reshape(r, d * r))

  def fisher(self) -> Array:
    """F = Uᵀ U `[P, P]`."""
    out = _dot(self.u.T, self.u, self.dtype)
    return out if self.axis is None else jax.lax.psum(out, self.axis)


def _eigh(m: Array) -> tuple[Array, Array, Array]:
  """`(eigenvalues clipped at 0, eigenvectors, the pseudo-inverse's cutoff)`; eigenvalues at
  most `n` eps times the largest are below what the factorisation resolves."""
  lam, q = jnp.linalg.eigh(m)
  lam = jnp.maximum(lam, 0)
  cut = m.shape[0] * jnp.finfo(m.dtype).eps * lam[-1]
  return lam, q, cut


def _sample_space(op: _Sharded, eps, g, prev, damping, momentum, tol):
  """(F + λ)⁻¹(g + λμ φ) through K (package docstring), and the info."""
  k = op.kernel()
  lam, q, cut = _eigh(k)
  if eps is None:
    a0, r0, c = jnp.zeros((k.shape[0],), g.dtype), g, jnp.zeros((), g.dtype)
  else:
    eps = op.gather(eps.astype(g.dtype))
    h = op.transpose_times(eps[:, None])[:, 0]
    hh = jnp.vdot(h, h)
    c = jnp.where(hh > 0, jnp.vdot(g, h) / jnp.where(hh > 0, hh, 1), 0)
    a0, r0 = c * eps, g - c * h
  b = op.times(jnp.stack([r0, prev], axis=1))  # [R, 2]: U r₀, U φ.
  qb = _dot(q.T, b)
  # The least-squares coefficients of r₀ on the rows (pseudo-inverse of K).
  a1 = _dot(q, jnp.where(lam > cut, qb[:, 0] / jnp.where(lam > cut, lam, 1), 0))
  r = r0 - op.transpose_times(a1[:, None])[:, 0]
  a = a0 + a1
  # The rounding scale of g = Σ_i a_i u_i: the root sum of squares of its terms' norms.
  scale = jnp.maximum(jnp.sqrt(jnp.sum(a**2 * jnp.diagonal(k))), jnp.linalg.norm(g))
  r_norm = jnp.linalg.norm(r)
  keep = r_norm > tol * scale
  ur = b[:, 0] - _dot(k, a1)  # U r = U r₀ − K a₁.
  rhs = a - momentum * b[:, 1] - jnp.where(keep, ur / damping, 0)
  y = _dot(q, _dot(q.T, rhs) / (lam + damping))
  phi = momentum * prev + op.transpose_times(y[:, None])[:, 0] + jnp.where(keep, r / damping, 0)
  info = {
    "kernel_trace": jnp.trace(k),
    "kernel_max_eigenvalue": lam[-1],
    "kernel_min_eigenvalue": lam[0],
    "kernel_rank": jnp.sum(lam > cut),
    "loss_factor": c,
    "remainder_norm": r_norm / jnp.where(scale > 0, scale, 1),
    "remainder_kept": keep,
  }
  return phi, info


def _parameter_space(op: _Sharded, g, prev, damping, momentum, tol):
  """(F + λ)⁻¹(g + λμ φ) through F = UᵀU; g's part in F's null space follows the same rule."""
  f = op.fisher()
  lam, v, cut = _eigh(f)
  gv, pv = _dot(v.T, g), _dot(v.T, prev)
  live = lam > cut
  r_norm = jnp.linalg.norm(jnp.where(live, 0, gv))
  scale = jnp.linalg.norm(g)
  keep = r_norm > tol * scale
  gv = jnp.where(live | keep, gv, 0)
  phi = _dot(v, (gv + damping * momentum * pv) / (lam + damping))
  info = {
    "kernel_trace": jnp.trace(f),
    "kernel_max_eigenvalue": lam[-1],
    "kernel_min_eigenvalue": jnp.min(jnp.where(live, lam, lam[-1])),
    "kernel_rank": jnp.sum(live),
    "loss_factor": jnp.zeros((), g.dtype),
    "remainder_norm": r_norm / jnp.where(scale > 0, scale, 1),
    "remainder_kept": keep,
  }
  return phi, info


def direction(
  rows: Rows, grads, previous=None, *, damping, momentum=0.0, axis_name: AxisName = None
):
  """φ = (F + λI)⁻¹(g + λμ φ_prev), F = UᵀU the rows' curvature (package docstring).

  Solved in sample space (R × R) when the rows (every device's) number at most the parameters,
  else in parameter space (P × P). Pure and jit-compatible; a non-finite result is left to the
  caller's guard.

  Args:
    rows: `rows(...)`'s result for this step's batch.
    grads: g, the loss's gradient (params-shaped; under `axis_name` the same on each device).
    previous: φ_prev, the last direction (params-shaped), or None (zeros).
    damping: λ > 0 (a scalar, may be traced).
    momentum: μ, SPRING's decay of the previous direction (0: MinSR / ENGD-Woodbury).
    axis_name: the axis `rows` was computed under (the same one), or None.

  Returns:
    `(direction, info)`: the direction shaped and typed like `grads`; scalars `kernel_trace`,
    `kernel_max_eigenvalue`, `kernel_min_eigenvalue` (of K, or F's resolved part),
    `kernel_rank` (eigenvalues above the cutoff), `loss_factor` (the fitted c, 0 without
    residuals), `remainder_norm` (‖r‖ over its rounding scale), `remainder_kept` and
    `example_mismatch` (from `rows`).

  Raises:
    ValueError: `grads` or `previous` not of the rows' parameter count, or an `axis_name`
      whose size differs from the one `rows` was computed under.
  """
  _compat.one_lapack_thread()  # OpenBLAS's spinning threads would take XLA's cores.
  devices = axis_size(axis_name)
  if devices != rows.num_devices:
    raise ValueError(
      f"`axis_name`={axis_name!r} has {devices} devices, but the rows were computed under an "
      f"axis of {rows.num_devices}: pass `direction` the `axis_name` given to `rows`."
    )
  u = rows.matrix
  dtype = jnp.promote_types(u.dtype, jnp.float32)
  g, unravel = ravel_pytree(grads)
  p = u.shape[1]
  if g.shape != (p,):
    raise ValueError(
      f"`grads` has {g.size} entries, but the rows have {p} columns (the registration's "
      "params, raveled): pass the gradient of the registered params."
    )
  prev = jnp.zeros((p,), dtype) if previous is None else ravel_pytree(previous)[0]
  if prev.shape != (p,):
    raise ValueError(
      f"`previous` has {prev.size} entries, expected {p} (a direction shaped like the params)."
    )
  g, prev = g.astype(dtype), prev.astype(dtype)
  damping, momentum = jnp.asarray(damping, dtype), jnp.asarray(momentum, dtype)
  tol = _ROUNDING * jnp.finfo(dtype).eps
  op = _Sharded(u, axis_name, dtype)
  if u.shape[0] * devices <= p:
    phi, info = _sample_space(op, rows.residuals, g, prev, damping, momentum, tol)
  else:
    phi, info = _parameter_space(op, g, prev, damping, momentum, tol)
  info["example_mismatch"] = rows.example_mismatch
  return unravel(phi.astype(g.dtype)), info
