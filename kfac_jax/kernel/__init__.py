"""The natural gradient in sample space (SR / MinSR, ENGD-Woodbury, SPRING): the numerical core.

The second curvature beside K-FAC, read from the same `kfac_jax.Registration`; it needs no layer
structure. Two pure functions, called inside the user's jit / pmap / shard_map:
`rows(registration, params, batch, rng) -> Rows` and
`direction(rows, grads, previous, damping=, momentum=) -> (direction, info)`.

**The curvature.** Per loss tag ℓ with N_ℓ examples (over all devices) the registration's
Fisher / GGN is `F = Σ_ℓ (1/N_ℓ) Σ_n J_nᵀ (w F_z) J_n`, J_n the Jacobian of example n's
prediction in the params. The estimation mode gives per example S_ℓ output vectors v_s with
`(1/S_ℓ) Σ_s v_s v_sᵀ ≈ w F_z` (`kfac_jax._losses.output_cotangents`). The rows
`u_{ℓ,n,s} = J_nᵀ v_s / √(N_ℓ S_ℓ)` stacked as U (R × P, R = Σ_ℓ N_ℓ S_ℓ) give `F = UᵀU`, the
estimate K-FAC's blocks approximate (the same draws for the same `rng`); complex predictions
are tagged as their real and imaginary parts. The kernel is `K = U Uᵀ` (R × R).

**The direction.** With SPRING's prior (Goldshlager, Abrahamsen & Lin 2024),
`φ_k = argmin ‖Uφ − ε‖² + λ‖φ − μ φ_{k−1}‖² = (F + λI)⁻¹(g + λμ φ_{k−1})`, `g = Uᵀε`,
which in sample space is `φ_k = μ φ_{k−1} + Uᵀ(K + λI)⁻¹(ε − μ U φ_{k−1})` (μ = 0: MinSR /
ENGD-Woodbury). A gradient outside U's row space takes Woodbury's identity
`(F + λI)⁻¹r = (r − Uᵀ(K + λI)⁻¹U r) / λ`. When R > P (every device's rows) the same φ is
solved in parameter space, through `F + λI` (full ENGD).

**Stability.** Woodbury's form on all of g cancels catastrophically: the rounding error of g
(about eps ‖g‖, in every direction) is amplified by 1/λ. So the part of g in the row space goes
through coefficients, never through g: `g = Uᵀa + r` with
  * `a₀ = c ε` where the loss is the tags': ε the tags' whitened residuals (`Rows.residuals`,
    `kfac_jax._losses.whitened_residual`), c the loss factor `L = c T` fitted by least squares,
    `c = ⟨g, Uᵀε⟩ / ‖Uᵀε‖²` (the fit leaves the smallest remainder); tags without targets and
    the random modes give no ε, so their part falls to a₁;
  * `a₁ = K⁺ U (g − Uᵀa₀)`, the least-squares rest (all of g for variational Monte Carlo): K's
    pseudo-inverse by its eigendecomposition, eigenvalues at most R eps λ_max counted as zero,
    because K is singular by construction in some modes;
  * `r = g − Uᵀa`, the remainder, by Woodbury's identity, unless `‖r‖ ≤ 1000 eps s`, with
    `s = max(‖g‖, (Σ_i a_i² ‖u_i‖²)^½)` the rounding scale of the sum of the terms `a_i u_i`:
    then r is rounding error and is dropped (1000 covers a backward pass through tens of
    layers; a kept remainder's 1/λ-amplified noise is then a relative 1e-3 of its term).
Then `φ = μ φ_prev + Uᵀ(K + λI)⁻¹(a − μ U φ_prev − U r / λ) + r / λ`. In parameter space g's
component in F's null space is r, under the same rule with `s = ‖g‖`.

**Data parallel.** Under pmap / shard_map over `axis_name` each device computes its rows; K is
assembled by a ring of `ppermute`s without gathering U, the R × R solve is replicated and `Uᵀy`
is a `psum`, so every device returns the same direction. Under plain `jit` no axis is needed.

Cost, memory and the assumption that each tagged output depends on its own example only:
docs/curvatures.rst.
"""

from kfac_jax.kernel._front import (
  KernelNgdState,
  KernelState,
  ScaleByKernelNgdState,
  kernel_ngd,
  scale_by_kernel_ngd,
)
from kfac_jax.kernel._rows import Rows, TagRows, rows
from kfac_jax.kernel._solve import direction

__all__ = [
  "KernelNgdState",
  "KernelState",
  "Rows",
  "ScaleByKernelNgdState",
  "TagRows",
  "direction",
  "kernel_ngd",
  "rows",
  "scale_by_kernel_ngd",
]
