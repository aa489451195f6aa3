"""The tracer: from `loss_fn(params, batch)` to static layer and loss descriptions.

One face, `scan(loss_fn, params, batch, ...) -> ScanResult`; the static descriptions the blocks
read live in `kfac_jax._specs`, so the blocks never import this.
"""

from kfac_jax._errors import RegistrationError
from kfac_jax._specs import FallbackInfo, LayerSpec, param_paths
from kfac_jax.scan._graph import FlatGraph, HoistedTap, aval_of, is_key
from kfac_jax.scan._kinds import KINDS
from kfac_jax.scan._layer_config import LayerConfig
from kfac_jax.scan._layer_config import check as check_layer_config
from kfac_jax.scan._scanner import ScanResult, scan, tag_names

__all__ = [
  "KINDS",
  "FallbackInfo",
  "FlatGraph",
  "HoistedTap",
  "LayerConfig",
  "LayerSpec",
  "RegistrationError",
  "ScanResult",
  "aval_of",
  "check_layer_config",
  "is_key",
  "param_paths",
  "scan",
  "tag_names",
]
