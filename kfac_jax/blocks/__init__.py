"""Curvature blocks: one per layer, chosen from the layer kind and its approximation."""

from kfac_jax.blocks._base import Block, BlockConfig, DampingMode, StackedUses
from kfac_jax.blocks._concat import ConcatBlock
from kfac_jax.blocks._ekfac import EKFACBlock
from kfac_jax.blocks._generic import DiagonalBlock, FullBlock
from kfac_jax.blocks._kronecker import KroneckerBlock, KroneckerDenseBlock
from kfac_jax.blocks._shared import SeriesKroneckerBlock
from kfac_jax.blocks._stacked import StackedBlock

_BLOCKS: dict[tuple[str, str], type[Block]] = {
  ("dense", "kron"): KroneckerBlock,
  ("dense", "kron_in_diag"): KroneckerBlock,
  ("dense", "kron_out_diag"): KroneckerBlock,
  ("dense", "kron_both_diag"): KroneckerBlock,
  ("dense", "diagonal"): DiagonalBlock,
  ("dense", "full"): FullBlock,
  ("dense", "expand"): KroneckerBlock,
  ("dense", "reduce"): KroneckerBlock,
  ("dense", "kron_indep"): KroneckerBlock,
  ("dense", "ekfac"): EKFACBlock,
  ("conv", "ekfac"): EKFACBlock,
  ("dense", "kron_series_1"): SeriesKroneckerBlock,
  ("dense", "kron_series_2"): SeriesKroneckerBlock,
  ("embedding", "kron_indep"): KroneckerBlock,
  ("conv", "kron"): KroneckerBlock,
  ("conv", "kron_sua"): KroneckerBlock,
  ("conv", "kron_in_diag"): KroneckerBlock,
  ("conv", "kron_out_diag"): KroneckerBlock,
  ("conv", "kron_both_diag"): KroneckerBlock,
  ("embedding", "kron_out_diag"): KroneckerBlock,
  ("conv", "kron_indep"): KroneckerBlock,
  ("conv", "diagonal"): DiagonalBlock,
  ("conv", "full"): FullBlock,
  ("embedding", "kron"): KroneckerBlock,
  ("scale_and_shift", "full"): FullBlock,
  ("scale_and_shift", "diagonal"): DiagonalBlock,
  ("generic", "diagonal"): DiagonalBlock,
  ("generic", "full"): FullBlock,
}


def make_block(spec, config: BlockConfig) -> Block:
  """The block class for `spec.kind` and `spec.approx` (wrapped for concatenated leaves,
  vmapped over a stack of layers)."""
  inner = spec.logical if spec.concat else spec.stack_inner if spec.stack_size else None
  if inner is not None and inner.approx == "ekfac":
    # EKFAC's statistics need its eigenbasis (the cache); the wrappers do not pass it through.
    what = "concatenated kernels" if spec.concat else "a stack of layers (scan / vmap)"
    raise ValueError(
      f"layer `{spec.name}`: approx='ekfac' is not supported on {what}; give it 'kron' "
      f"(e.g. LayerConfig(overrides={{{spec.name!r}: 'kron'}}))."
    )
  if spec.concat:
    return ConcatBlock(spec, config, make_block(spec.logical, config))
  if spec.stack_size:
    return StackedBlock(spec, config, make_block(spec.stack_inner, config))
  try:
    cls = _BLOCKS[(spec.kind, spec.approx)]
  except KeyError:
    choices = sorted(a for k, a in _BLOCKS if k == spec.kind)
    raise ValueError(
      f"layer `{spec.name}` ({spec.kind}) has no block for approximation {spec.approx!r}; "
      f"choose one of {choices}."
    ) from None
  return cls(spec, config)


__all__ = [
  "Block",
  "BlockConfig",
  "ConcatBlock",
  "DampingMode",
  "DiagonalBlock",
  "EKFACBlock",
  "FullBlock",
  "KroneckerBlock",
  "KroneckerDenseBlock",
  "SeriesKroneckerBlock",
  "StackedBlock",
  "StackedUses",
  "make_block",
]
