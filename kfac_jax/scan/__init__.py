"""The tracer: from `loss_fn(params, batch)` to static layer and loss descriptions.

One face, `scan(loss_fn, params, batch, ...) -> ScanResult`; the modules behind it form the
pipeline, each importing only the ones before it:

  `_graph`         the traced program as a flat graph (nested jit, remat and scans inlined);
  `_batch_axes`    which axis of each value is the batch;
  `_index`         `GraphIndex`, a frozen index of the graph (views, real uses, consumers);
  `_matchers`, `_stacked`, `_matchers_embed`, `_matchers_shared`
                   pure matching functions, one family per module;
  `_kinds`         the vocabulary: one `LayerKind` record per layer kind (info type, matchers
                   and their pass, approximations alone and shared, manual tag reader);
  `_layer_config`  `LayerConfig`: which approximation each layer gets;
  `_scanner`       orchestration: runs the kinds' matchers in order, turns matches into specs.

The static descriptions the blocks read (`LayerSpec`, the `*Info` types, `Kind`,
`Approximation`) live in the leaf module `kfac_jax._specs`, so `kfac_jax.blocks` never imports
the tracer.
"""

from kfac_jax._specs import (
  FallbackInfo,
  LayerSpec,
  LossSpec,
  RegistrationCheckError,
  RegistrationError,
  UncoveredParametersWarning,
  param_paths,
)
from kfac_jax.scan._graph import FlatEqn, FlatGraph, HoistedTap, aval_of, is_key
from kfac_jax.scan._kinds import KINDS, Approximation, Kind, LayerKind
from kfac_jax.scan._layer_config import LayerConfig
from kfac_jax.scan._layer_config import check as check_layer_config
from kfac_jax.scan._scanner import ScanResult, scan, tag_names

__all__ = [
  "KINDS",
  "Approximation",
  "FallbackInfo",
  "FlatEqn",
  "FlatGraph",
  "HoistedTap",
  "Kind",
  "LayerConfig",
  "LayerKind",
  "LayerSpec",
  "LossSpec",
  "RegistrationCheckError",
  "RegistrationError",
  "ScanResult",
  "UncoveredParametersWarning",
  "aval_of",
  "check_layer_config",
  "is_key",
  "param_paths",
  "scan",
  "tag_names",
]
