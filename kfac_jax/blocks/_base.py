"""The curvature-block interface.

A block is a static object (its layer spec and configuration); its numbers live in two plain
dicts of arrays that the estimator keeps in its state:

  factors  the EMA statistics (e.g. `{"a": A, "g": G}` for a Kronecker block), undamped;
  cache    what `update_inverses` derives from the factors and the damping λ: matrix powers,
           eigen-decompositions, Cholesky factors, and `"damping"`, the λ they were built with.

Vectors are the block's parameter leaves (parameter-shaped arrays), in `spec.leaf_indices` order.
"Damped block" means the matrix the block actually multiplies by: `A_λ ⊗ G_λ` with π-adjusted
factored Tikhonov damping for Kronecker blocks in "factored" mode, and `F + λ I` otherwise.
Concrete blocks are final: they implement this interface and are never subclassed.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from kfac_jax._specs import LayerSpec

Array = jax.Array
DampingMode = Literal["factored", "eigen"]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static options shared by all blocks of one estimator.

  Attributes:
    exps: matrix powers the cache is prepared for (1 is always available).
    damping_mode: "factored" (π-adjusted factored Tikhonov damping, the K-FAC default) or
      "eigen" (exact `A ⊗ G + λ I` through eigen-decompositions of the factors).
    cholesky: also cache Cholesky factors (for `multiply_cholesky`).
    cholesky_inverse: also cache inverse Cholesky factors.
    stats_dtype: dtype in which batch statistics are computed and the factors (their moving
      averages) are stored: float32 by default, float64 under x64, or bfloat16 / float16 to
      halve the factors' memory.
    inverse_dtype: dtype of everything `update_inverses` derives (powers, eigen-decompositions,
      Cholesky factors, the damping) and of the products: float32 or float64. Factors are cast
      to it before they are factorised.
  """

  exps: tuple[float, ...] = (-1.0,)
  damping_mode: DampingMode = "factored"
  cholesky: bool = False
  cholesky_inverse: bool = False
  stats_dtype: Any = jnp.float32
  inverse_dtype: Any = jnp.float32

  @property
  def accum_dtype(self):
    """The dtype batch statistics are accumulated in: `stats_dtype`, at least float32."""
    return jnp.promote_types(self.stats_dtype, jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedUses:
  """The T taps of one layer inside one scan, stacked along the steps (execution order).

  Attributes:
    inputs: the recorded input operands, each `[T, ...]`.
    g: the output gradients, `[samples, T, ...]`.
  """

  inputs: tuple[Any, ...]
  g: Any

  def unstack(self) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """The per-use `(inputs, g)` pairs (one slice per step)."""
    steps = self.g.shape[1]
    return tuple((tuple(x[t] for x in self.inputs), self.g[:, t]) for t in range(steps))


class Block(abc.ABC):
  """Abstract curvature block: statistics, damped powers, Cholesky products, dense matrix."""

  def __init__(self, spec: LayerSpec, config: BlockConfig):
    self.spec = spec
    self.config = config

  @property
  def name(self) -> str:
    return self.spec.name

  def group_key(self) -> tuple:
    """Blocks with equal keys have identically shaped state and are batched with vmap."""
    return (type(self).__name__, self.spec.factor_shapes, self.spec.approx)

  def accepts_stacked_uses(self) -> bool:
    """Whether `batch_factors` takes a `StackedUses` (else it gets the unstacked uses)."""
    return False

  # -- statistics ------------------------------------------------------------------------------

  @abc.abstractmethod
  def init_factors(self) -> dict[str, Array]:
    """Zero statistics."""

  @abc.abstractmethod
  def batch_factors(self, data: Any, batch_size: int) -> dict[str, Array]:
    """This batch's statistics from the curvature pass's raw data for the block."""

  # -- inverses --------------------------------------------------------------------------------

  @abc.abstractmethod
  def init_cache(self) -> dict[str, Array]:
    """A cache that makes every power act as the identity (before the first inverse update)."""

  @abc.abstractmethod
  def compute_cache(self, factors: dict[str, Array], damping: Array) -> dict[str, Array]:
    """Powers / decompositions of the damped block. Pure; vmapped over blocks of a group."""

  # -- products --------------------------------------------------------------------------------

  @abc.abstractmethod
  def multiply_matpower(self, factors, cache, vecs: Sequence[Array], exp: float) -> list[Array]:
    """(damped block)^exp · vecs; `exp` is 1 or one of `config.exps`."""

  @abc.abstractmethod
  def multiply_cholesky(
    self, factors, cache, vecs: Sequence[Array], *, transpose: bool, inverse: bool
  ) -> list[Array]:
    """C·v, Cᵀ·v, C⁻¹·v or C⁻ᵀ·v for a factor C with C Cᵀ = damped block."""

  @abc.abstractmethod
  def multiply_undamped(self, factors, vecs: Sequence[Array]) -> list[Array]:
    """The undamped estimate times vecs (used by `to_dense`)."""

  # -- helpers ---------------------------------------------------------------------------------

  def to_dense(self, factors) -> Array:
    """The undamped block as a `[n, n]` matrix over its leaves, raveled and concatenated."""
    sizes = [math.prod(s) for s in self.spec.param_shapes]
    n = sum(sizes)

    def column(e):
      vecs, off = [], 0
      for size, shape in zip(sizes, self.spec.param_shapes):
        vecs.append(e[off : off + size].reshape(shape))
        off += size
      return jnp.concatenate([v.ravel() for v in self.multiply_undamped(factors, vecs)])

    factors = jax.tree_util.tree_map(lambda x: x.astype(self.config.inverse_dtype), factors)
    return jax.vmap(column, out_axes=1)(jnp.eye(n, dtype=self.config.inverse_dtype))

  def state_bytes(self) -> int:
    shapes = jax.eval_shape(lambda: (self.init_factors(), self.init_cache()))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))

  def check_exp(self, exp: float) -> None:
    if exp != 1 and exp not in self.config.exps:
      raise ValueError(
        f"matrix power {exp} was not prepared: the estimator was built with exps="
        f"{self.config.exps} (1 is always available). Add {exp} to `exps`."
      )
