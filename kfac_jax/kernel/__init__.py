"""The natural gradient in sample space (SR / MinSR, ENGD-Woodbury, SPRING): the numerical core.

The second curvature beside K-FAC, read from the same `kfac_jax.Registration` (loss tags,
`curvature_fn`, tags in custom_jvp rules, `has_aux`, estimation modes); it needs no layer
structure. Two pure functions, called inside the user's jit / pmap / shard_map:
`rows(registration, params, batch, rng) -> Rows` and
`direction(rows, grads, previous, damping=, momentum=) -> (direction, info)`.

**The curvature.** Per loss tag ℓ with N_ℓ examples (over all devices) the registration's
Fisher / GGN is `F = Σ_ℓ (1/N_ℓ) Σ_n J_nᵀ (w F_z) J_n` (`kfac_jax._curvature`), J_n the
Jacobian of example n's prediction in the params. The estimation mode gives per example S_ℓ
output vectors v_s with `(1/S_ℓ) Σ_s v_s v_sᵀ ≈ w F_z` (`kfac_jax._losses.output_cotangents`:
the exact modes one per output coordinate, `√K B e_k` with `B Bᵀ = F_z`; the sampled modes S
draws; "empirical" the example's loss gradient). The rows `u_{ℓ,n,s} = J_nᵀ v_s / √(N_ℓ S_ℓ)`
stacked as U (R × P, R = Σ_ℓ N_ℓ S_ℓ) give `F = UᵀU`, the same estimate K-FAC's blocks
approximate (the same draws for the same `rng`); complex predictions are tagged as their real
and imaginary parts, so their rows give the same real Fisher. The kernel is `K = U Uᵀ` (R × R).

**The direction.** With SPRING's prior (Goldshlager, Abrahamsen & Lin 2024),
`φ_k = argmin ‖Uφ − ε‖² + λ‖φ − μ φ_{k−1}‖² = (F + λI)⁻¹(g + λμ φ_{k−1})`, `g = Uᵀε`,
which in sample space is `φ_k = μ φ_{k−1} + Uᵀ(K + λI)⁻¹(ε − μ U φ_{k−1})` (μ = 0: MinSR /
ENGD-Woodbury). A gradient outside U's row space (a sampled Fisher with cross-entropy, an L2
term, untagged loss terms) takes Woodbury's identity `(F + λI)⁻¹r = (r − Uᵀ(K + λI)⁻¹U r) / λ`.
When R > P the same φ is solved in parameter space, through `F + λI` (full ENGD); `direction`
chooses by comparing R (every device's rows) with P.

**Stability.** Woodbury's form on all of g cancels catastrophically: the rounding error of g
itself (about eps ‖g‖, in every direction) is amplified by 1/λ. So the part of g in the row
space goes through coefficients ε, never through g: `g = Uᵀa + r` with
  * `a₀ = c ε` where the loss is the tags' (no `curvature_fn`, no tags in a rule): ε are the
    tags' whitened residuals (`Rows.residuals`, `B ε = √w ∇_z ℓ / √N_ℓ` per example in the
    exact modes, `√(w / N_ℓ)` in "empirical"; `kfac_jax._losses.whitened_residual`) and c the
    loss factor `L = c T`, fitted by least squares `c = ⟨g, Uᵀε⟩ / ‖Uᵀε‖²` (any c is exact,
    the fit leaves the smallest remainder; the audit's factor, rounded to 3 digits, would leave
    a row-space remainder for Woodbury's form to amplify); tags without targets and the
    random modes give no ε, so their part falls to a₁;
  * `a₁ = K⁺ U (g − Uᵀa₀)`, the least-squares rest (all of g for variational Monte Carlo,
    where the loss is the energy and the tags are log ψ's): K's pseudo-inverse by its
    eigendecomposition, eigenvalues at most R eps λ_max counted as zero, because K is
    singular by construction in some modes and a damped Cholesky would amplify its null space;
  * `r = g − Uᵀa`, the remainder, by Woodbury's identity, unless `‖r‖ ≤ 1000 eps s`, with
    `s = max(‖g‖, (Σ_i a_i² ‖u_i‖²)^½)` the size of the rounding error of a sum of the terms
    `a_i u_i` (independent roundings add in quadrature): then r is that rounding error, and is
    dropped. The factor 1000 covers the per-term error of a backward pass through tens of
    layers; a remainder that is kept is at least 1000 times its own rounding noise, whose 1/λ
    amplification is then a relative 1e-3 of the remainder's term.
Then `φ = μ φ_prev + Uᵀ(K + λI)⁻¹(a − μ U φ_prev − U r / λ) + r / λ`. In parameter space the
split is by F's eigenvectors: g's component in F's null space is r, under the same rule with
`s = ‖g‖`.

**Cost and memory.** Time: O(R S_p) for the rows (one forward and S backward passes per
example, S_p one pass's cost), O(R² P) for K and O(R³) for its eigendecomposition (sample
space), or O(R P²) and O(P³) (parameter space). Peak memory, in bytes with b the params'
itemsize and b' = max(b, 4):
  U: `R P b`, written in place chunk by chunk;
  the per-example passes: about `C S (2 P b + A)` per chunk, C = `chunk_size` examples (all of
  a tag's without it), S its vectors per example, A one example's forward and backward
  activations;
  K and its eigenvectors: `2 R² b'` (sample space), or F and its eigenvectors `2 P² b'`.
Under `axis_name` each device holds its own `R_d P b` rows, two row blocks during the ring,
and the whole K.

**Assumptions.** Each tagged output depends on its own example only (MLPs, PINN residuals,
wave functions): a tag's examples are the batch leaves whose leading axis has its size N_ℓ,
each evaluated alone. BatchNorm in training mode breaks it; `Rows.example_mismatch` (the
relative gap between each example's prediction alone and in the batch) shows it.

**Data parallel.** Under pmap / shard_map with the batch sharded over `axis_name`, each device
computes its rows; K is assembled without gathering U (a ring of `ppermute`s passes the row
blocks round, each device computes its rows of K, then the small `R_d × R` blocks are
gathered), the R × R solve is replicated, and `Uᵀy` is a `psum`: every device returns the same
direction (`shard_map` with `check_vma=False`, as for the library's other collectives). Under
plain `jit` with arrays sharded over a mesh of automatic axes no axis is needed.
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
