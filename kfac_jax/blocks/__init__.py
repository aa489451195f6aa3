"""Curvature blocks: one per layer, chosen from the layer kind and its approximation."""

from kfac_jax.blocks import _kronecker
from kfac_jax.blocks._base import (
  Block,
  BlockConfig,
  DampingMode,
  FactorSolve,
  StackedUses,
  batched_factorisations,
  compute_caches,
)
from kfac_jax.blocks._concat import ConcatBlock
from kfac_jax.blocks._ekfac import EKFACBlock
from kfac_jax.blocks._generic import DiagonalBlock, FullBlock
from kfac_jax.blocks._kronecker import KroneckerBlock, KroneckerDenseBlock
from kfac_jax.blocks._shared import SeriesKroneckerBlock
from kfac_jax.blocks._stacked import StackedBlock
from kfac_jax.blocks._state import (
  DiagonalCache,
  DiagonalFactors,
  EKFACCache,
  EKFACFactors,
  FactorCache,
  FullCache,
  FullFactors,
  KroneckerCache,
  KroneckerFactors,
  SeriesCache,
  SeriesFactors,
)

# The block classes that compute layers, each serving its (kind, approximation) pairs
# (`Block.serves`, unique: tests/scan/test_kinds.py). The wrappers (`ConcatBlock`, `StackedBlock`)
# are chosen by the spec's shape.
BLOCK_CLASSES: tuple[type[Block], ...] = (
  KroneckerBlock,
  EKFACBlock,
  SeriesKroneckerBlock,
  DiagonalBlock,
  FullBlock,
)
_BLOCKS = {pair: cls for cls in BLOCK_CLASSES for pair in cls.serves}


def serves(kind: str, approx: str) -> bool:
  """Whether some block class computes layers of `kind` with approximation `approx`."""
  return (kind, approx) in _BLOCKS


def block_class(spec) -> type[Block]:
  """The block class of a layer: `ConcatBlock` over concatenated leaves, `StackedBlock` for a
  stack of layers, else the one of `(spec.kind, spec.approx)`."""
  if spec.concat:
    return ConcatBlock
  if spec.stack_size:
    return StackedBlock
  try:
    return _BLOCKS[(spec.kind, spec.approx)]
  except KeyError:
    choices = sorted(a for k, a in _BLOCKS if k == spec.kind)
    raise ValueError(
      f"layer `{spec.name}` ({spec.kind}) has no block for approximation {spec.approx!r}; "
      f"choose one of {choices}."
    ) from None


def blocked_note(spec) -> str:
  """The `LayerSpec.note` on a layer's blocked factor sides (`_kronecker.blocked_note`)."""
  return _kronecker.blocked_note(spec) if block_class(spec) is KroneckerBlock else ""


def factor_shapes_for(spec) -> tuple[tuple[int, ...], ...]:
  """The factor shapes the layer's block will keep (`Block.factor_shapes_for`), before any
  block exists (the scanner sizes `LayerSpec.factor_shapes` with them)."""
  return block_class(spec).factor_shapes_for(spec)


def make_block(spec, config: BlockConfig) -> Block:
  """The block of a layer (`block_class`), wrapped for concatenated leaves, vmapped over a
  stack of layers."""
  cls = block_class(spec)
  if cls is ConcatBlock:
    return ConcatBlock(spec, config, make_block(spec.logical, config))
  if cls is StackedBlock:
    return StackedBlock(spec, config, make_block(spec.stack_inner, config))
  return cls(spec, config)


__all__ = [
  "Block",
  "BlockConfig",
  "ConcatBlock",
  "DampingMode",
  "DiagonalBlock",
  "DiagonalCache",
  "DiagonalFactors",
  "EKFACBlock",
  "EKFACCache",
  "EKFACFactors",
  "FactorCache",
  "FactorSolve",
  "FullBlock",
  "FullCache",
  "FullFactors",
  "KroneckerBlock",
  "KroneckerCache",
  "KroneckerDenseBlock",
  "KroneckerFactors",
  "SeriesCache",
  "SeriesFactors",
  "SeriesKroneckerBlock",
  "StackedBlock",
  "StackedUses",
  "BLOCK_CLASSES",
  "batched_factorisations",
  "block_class",
  "blocked_note",
  "compute_caches",
  "factor_shapes_for",
  "make_block",
  "serves",
]
