"""Listing the layers K-FAC registers for a loss function (TF K-FAC's LayerCollection view)."""

from __future__ import annotations

from collections.abc import Callable

from kfac_jax import _estimator, _scanner
from kfac_jax import blocks as _blocks


def scan_layers(loss_fn: Callable, params, batch, *,
                strict: bool = False) -> tuple[_scanner.LayerSpec, ...]:
  """Traces `loss_fn(params, batch)` and returns the layers K-FAC will use, in parameter order.

  Each `LayerSpec` has `name`, `kind` ("dense", "conv", "scale_and_shift", "embedding",
  "generic"), `param_paths` (e.g.
  `params/Dense_0/kernel`), `approx`, `factor_shapes` and `num_uses` (how many times the layer
  is applied: tied weights, the steps of a scan). Parameters outside every recognised
  layer get a diagonal generic block and one `UncoveredParametersWarning` naming them all
  (an error with `strict=True`).

  Raises:
    RegistrationError: no loss tag, or a malformed manual tag.
  """
  return _scanner.scan(loss_fn, params, batch, strict=strict).layers


def summary(loss_fn: Callable, params, batch, *, strict: bool = False) -> str:
  """A table of the registered layers: kind, approximation, parameters, factor shapes, memory.

  Memory is that of the block's state (factors plus the cached inverses for exps=(-1,)).

  Example:
    >>> print(kfac_jax.summary(loss_fn, params, batch))
  """
  layers = scan_layers(loss_fn, params, batch, strict=strict)
  config = _blocks.BlockConfig()
  return _estimator.format_table(layers, [_blocks.make_block(s, config) for s in layers])
