"""Listing the layers K-FAC registers for a loss function (TF K-FAC's LayerCollection view)."""

from __future__ import annotations

from collections.abc import Callable

from kfac_jax import _estimator, _layer_config, _scanner
from kfac_jax import blocks as _blocks


def scan_layers(loss_fn: Callable, params, batch, *, strict: bool = False,
                layers: _layer_config.LayerConfig | None = None
                ) -> tuple[_scanner.LayerSpec, ...]:
  """Traces `loss_fn(params, batch)` and returns the layers K-FAC will use, in parameter order.

  Each `LayerSpec` has `name`, `kind` ("dense", "conv", "scale_and_shift", "embedding",
  "generic"), `param_paths` (e.g.
  `params/Dense_0/kernel`), `approx`, `factor_shapes` and `num_uses` (how many times the layer
  is applied: tied weights, the steps of a scan) and `stack_size` (L for a stack of L layers
  whose leaves carry a leading layer axis: a scan over stacked layers, a vmapped ensemble; 0
  otherwise). Parameters outside every recognised
  layer get a diagonal generic block and one `UncoveredParametersWarning` naming them all
  (an error with `strict=True`). `layers` (a `kfac_jax.LayerConfig`) chooses approximations and
  linked groups as in the estimator.

  Raises:
    RegistrationError: no loss tag, a malformed manual tag, or a `layers` entry that does not fit.
  """
  return _scanner.scan(loss_fn, params, batch, strict=strict, layers=layers).layers


def summary(loss_fn: Callable, params, batch, *, strict: bool = False,
            layers: _layer_config.LayerConfig | None = None) -> str:
  """A table of the registered layers: kind, approximation, parameters, factor shapes, memory.

  Memory is that of the block's state (factors plus the cached inverses for exps=(-1,)).

  Example:
    >>> print(kfac_jax.summary(loss_fn, params, batch))
  """
  specs = scan_layers(loss_fn, params, batch, strict=strict, layers=layers)
  config = _blocks.BlockConfig()
  return _estimator.format_table(specs, [_blocks.make_block(s, config) for s in specs])


def check_registration(loss_fn: Callable, params, batch, *,
                       layers: _layer_config.LayerConfig | None = None
                       ) -> tuple[_scanner.LayerSpec, ...]:
  """Checks that every parameter is in exactly one curvature block; lists every problem at once.

  Scans `loss_fn(params, batch)` as the estimator would and collects every parameter that no
  layer covers (it would get a diagonal fallback block), every parameter registered twice (two
  manual tags, or a tag and a linked group), every manually tagged parameter whose number of
  tags differs from the number of times `loss_fn` uses it (a kernel applied twice but tagged
  once: its second use would be missing from the curvature; the message gives both counts), and
  every `layers.overrides` / `layers.linked` pattern that matches no parameter.

  Returns:
    The registered layers, as `scan_layers` returns them, when there is no problem.

  Raises:
    RegistrationCheckError: (a `RegistrationError`) with `.problems`, one line per problem,
      each naming the parameter path.
    RegistrationError: a problem that stops the scan itself (no loss tag, a malformed tag, an
      approximation that does not fit its layer, a linked group that splits a layer).

  Example:
    >>> kfac_jax.check_registration(loss_fn, params, batch)  # raises listing every problem
  """
  return _scanner.scan(loss_fn, params, batch, warn=False, layers=layers, collect=True).layers
