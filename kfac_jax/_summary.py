"""Listing the layers K-FAC registers for a loss function (TF K-FAC's LayerCollection view)."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from kfac_jax import _compat, _curvature, _registration
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _tracer


def _shared(who, registration, loss_fn, params, batch, strict, layers, axis_name, has_aux):
  """The registration given as `registration=` (checked against the other arguments), or
  None; `params` and `batch` belong to `loss_fn` and are left out with a registration."""
  if registration is not None and params is not None:
    raise ValueError(
      f"{who}: pass either `loss_fn, params, batch` or `registration=`, not both: the "
      "registration holds the params signature and example batch."
    )
  settings = {
    "strict": ("strict", strict, False),
    "layers": ("layer_config", layers, None),
    "axis_name": ("axis_name", axis_name, None),
    "has_aux": ("has_aux", has_aux, False),
  }
  return _registration.resolve(registration, loss_fn, batch, who, settings)


def _scan(loss_fn, params, batch, axis_name, has_aux, **kw) -> _tracer.ScanResult:
  part = _curvature.LossPart(loss_fn, has_aux)  # Checks `loss_fn` and `has_aux`.
  with _compat.axis_env([(n, 1) for n in _registration.axis_names(axis_name)]):
    return _tracer.scan(part, params, batch, has_aux=has_aux, **kw)


def scan_layers(
  loss_fn: Callable | None = None,
  params=None,
  batch=None,
  *,
  registration: _registration.Registration | None = None,
  strict: bool = False,
  layers: _tracer.LayerConfig | None = None,
  axis_name: _registration.AxisName = None,
  has_aux: bool = False,
) -> tuple[_tracer.LayerSpec, ...]:
  """Traces `loss_fn(params, batch)` and returns the layers K-FAC will use, in parameter order.

  Each `LayerSpec` names the layer, its kind, parameter paths (e.g. `params/Dense_0/kernel`),
  approximation, factor shapes, `num_uses` (tied weights, the steps of a scan) and `stack_size`.
  Parameters outside every recognised layer get a diagonal generic block and one
  `UncoveredParametersWarning` naming them all (an error with `strict=True`). `layers` (a
  `kfac_jax.LayerConfig`) chooses approximations and linked groups as in the estimator.
  `axis_name` (a name or a tuple of names) binds the collective axes of a model that uses them
  (e.g. linen `BatchNorm(axis_name="batch")`) with size 1 for the trace. `has_aux=True`:
  `loss_fn` returns `(loss, aux)`, as in `kfac_jax.value_and_grad`. `registration=` (instead of
  `loss_fn, params, batch`): the layers of that `kfac_jax.Registration` (no new scan).

  Raises:
    RegistrationError: no loss tag, a malformed manual tag, or a `layers` entry that does not fit.
    TypeError: `axis_name` is not a string or a tuple of strings.
  """
  args = (loss_fn, params, batch, strict, layers, axis_name, has_aux)
  reg = _shared("scan_layers", registration, *args)
  if reg is not None:
    return reg.layers
  return _scan(loss_fn, params, batch, axis_name, has_aux, strict=strict, layers=layers).layers


def summary(
  loss_fn: Callable | None = None,
  params=None,
  batch=None,
  *,
  registration: _registration.Registration | None = None,
  strict: bool = False,
  layers: _tracer.LayerConfig | None = None,
  axis_name: _registration.AxisName = None,
  has_aux: bool = False,
) -> str:
  """A table of the registered layers and a coverage report.

  The table lists each layer's kind, approximation, parameters, factor shapes, memory (the
  block's state: factors plus the cached inverses for exps=(-1,)) and a note saying why a
  layer's approximation differs from its kind's default. The report under it gives the share
  of the parameters in structured, non-generic blocks, the curvature state's bytes against the
  parameters', and, for every parameter in a diagonal fallback block, why no layer matched it
  ("sliced by a scan", "consumed by <primitive> (no matcher)", ...). The arguments as in
  `scan_layers`.

  Example:
    >>> print(kfac_jax.summary(loss_fn, params, batch))
  """
  reg = _shared("summary", registration, loss_fn, params, batch, strict, layers, axis_name, has_aux)
  if reg is not None:
    specs, blocks, params = reg.layers, reg.blocks(), reg.params_shape
  else:
    # No UncoveredParametersWarning: the report below says the same, in full.
    specs = _scan(
      loss_fn, params, batch, axis_name, has_aux, strict=strict, warn=False, layers=layers
    ).layers
    blocks = [_blocks.make_block(s, _blocks.BlockConfig()) for s in specs]
  table = format_table(_display_names(specs), blocks)
  return table + "\n\n" + coverage_report(specs, blocks, params)


def _display_names(specs: Sequence[_tracer.LayerSpec]) -> list[_tracer.LayerSpec]:
  """Specs renamed so that every row is distinguishable: a layer whose name is shared (its
  parameters sit in one dict with others) or a prefix of another's is shown by its first
  parameter's path."""
  counts = collections.Counter(s.name for s in specs)
  return [
    dataclasses.replace(s, name=s.param_paths[0])
    if counts[s.name] > 1 or any(o.name.startswith(s.name + "/") for o in specs)
    else s
    for s in specs
  ]


def coverage_report(
  specs: Sequence[_tracer.LayerSpec], blocks: Sequence[_blocks.Block], params
) -> str:
  """The lines `summary` prints under the table (see `summary`)."""
  total = sum(s.num_params for s in specs)
  structured = sum(s.num_params for s in specs if s.kind != "generic")
  leaves = jax.tree_util.tree_leaves(params)
  param_bytes = sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)
  state_bytes = sum(b.state_bytes() for b in blocks)
  share = structured / total if total else 1.0
  state_line = f"curvature state: {format_bytes(state_bytes)}"
  if param_bytes:
    state_line += f" ({state_bytes / param_bytes:.2f}x the parameters' {format_bytes(param_bytes)})"
  kinds = ", ".join(k.replace("_", "-") for k in _tracer.KINDS if k != "generic")
  lines = [
    f"layer blocks ({kinds}) hold {structured} of {total} parameters ({100 * share:.1f}%)",
    state_line,
  ]
  fallbacks = [s for s in specs if s.source == "fallback"]
  if fallbacks:
    lines.append(f"fallback (diagonal) blocks, {len(fallbacks)}: why no layer matched")
    for s in fallbacks:
      reason = s.info.reason if isinstance(s.info, _tracer.FallbackInfo) else "unknown"
      lines.append(f"  {s.param_paths[0]}: {reason}")
  return "\n".join(lines)


def check_registration(
  loss_fn: Callable | None = None,
  params=None,
  batch=None,
  *,
  registration: _registration.Registration | None = None,
  layers: _tracer.LayerConfig | None = None,
  axis_name: _registration.AxisName = None,
  has_aux: bool = False,
) -> tuple[_tracer.LayerSpec, ...]:
  """Checks that every parameter is in exactly one curvature block; lists every problem at once.

  Scans `loss_fn(params, batch)` as the estimator would and collects every parameter that no
  layer covers (with why no layer matched it), every parameter registered twice (two manual
  tags, or a tag and a linked group), every manually tagged parameter whose number of tags
  differs from the number of times `loss_fn` uses it, and every `layers.overrides` /
  `layers.linked` pattern that matches no parameter. `axis_name` and `has_aux` as in
  `scan_layers`. `registration=` checks a `kfac_jax.Registration` (instead of `loss_fn, params,
  batch`).

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
  args = (loss_fn, params, batch, False, layers, axis_name, has_aux)
  reg = _shared("check_registration", registration, *args)
  if reg is not None:
    loss_fn, params, batch = reg.loss_fn, reg.params_shape, reg.example_batch
    axis_name, has_aux, layers = reg.axis_name, reg.has_aux, reg.layer_config
  return _scan(
    loss_fn, params, batch, axis_name, has_aux, warn=False, layers=layers, collect=True
  ).layers


def _relative_paths(paths: Sequence[str]) -> str:
  """The parameter paths without the directory they all share (`kernel, bias` for a dense
  layer; `hi/kernel, hf/kernel, ...` for kernels concatenated from one module's leaves)."""
  common = len(os.path.commonprefix([p.split("/")[:-1] for p in paths]))
  return ", ".join("/".join(p.split("/")[common:]) for p in paths)


def format_table(
  layers: Sequence[_tracer.LayerSpec],
  blocks: Sequence[_blocks.Block],
  param_bytes: int | None = None,
) -> str:
  """The layer table; with `param_bytes`, the total row compares the state with the parameters."""
  rows = [("layer", "kind", "uses", "approx", "parameters", "factor shapes", "memory", "note")]
  total = 0
  for s, b in zip(layers, blocks):
    nbytes = b.state_bytes()
    total += nbytes
    shapes = " ".join("x".join(map(str, f)) for f in b.factor_shapes)
    kind = s.kind + (f" (stack of {s.stack_size})" if s.stack_size else "")
    rows.append(
      (
        s.name,
        kind + ("" if s.source == "auto" else f" ({s.source})"),
        str(s.num_uses),
        s.approx,
        _relative_paths(s.param_paths),
        shapes,
        format_bytes(nbytes),
        s.note,
      )
    )
  ratio = (
    f"{total / param_bytes:.2f}x the parameters' {format_bytes(param_bytes)}" if param_bytes else ""
  )
  values = f"{sum(s.num_params for s in layers)} values"
  rows.append(("total", "", "", "", values, "", format_bytes(total), ratio))
  if not any(s.note for s in layers):  # The last column holds the ratio only: no header.
    rows[0] = rows[0][:-1] + ("",)
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = []
  for k, r in enumerate(rows):
    lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if k == 0 or k == len(rows) - 2:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def format_bytes(n: float) -> str:
  """`n` bytes for people: "512 B", "1.5 KiB", ..., "2.0 GiB"."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      break
    n /= 1024
  return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
