"""Listing the layers K-FAC registers for a loss function (TF K-FAC's LayerCollection view)."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from kfac_jax import _compat, _registration
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _tracer


def summary(
  loss_fn: Callable | None = None,
  params=None,
  batch=None,
  *,
  registration: _registration.Registration | None = None,
) -> str:
  """A table of the registered layers (kind, approximation, parameters, factor shapes, memory,
  notes) and a coverage report (the share in layer blocks, the state's bytes, the fallbacks).

  Args:
    loss_fn, params, batch: the loss function, registered with the default settings.
    registration: a `kfac_jax.Registration` instead (no new scan).

  Example:
    >>> print(kfac_jax.summary(loss_fn, params, batch))
  """
  reg = _registration.shared(registration, loss_fn, "summary", ("params", params), ("batch", batch))
  if reg is None:  # No warnings: the report says the same, in full.
    reg = _registration.Registration(loss_fn, params, batch, warn=False)  # type: ignore[arg-type]
  specs, blocks = reg.layers, reg.blocks()
  table = format_table(_display_names(specs), blocks)
  return table + "\n\n" + coverage_report(specs, blocks, reg.params_shape)


def _display_names(specs: Sequence[_tracer.LayerSpec]) -> list[_tracer.LayerSpec]:
  """Specs renamed by their first parameter's path where a name is shared or a prefix."""
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
) -> tuple[_tracer.LayerSpec, ...]:
  """Checks that every parameter is in exactly one curvature block; lists every problem at once.

  Collects every parameter no layer covers, every parameter registered twice, and every
  manually tagged parameter whose number of tags differs from its number of uses.

  Args:
    loss_fn, params, batch: the loss function, scanned with the default settings.
    registration: a `kfac_jax.Registration` instead, scanned again with its settings.

  Returns:
    The registered layers, as `Registration.layers` lists them, when there is no problem.

  Raises:
    RegistrationCheckError: with `.problems`, one line per problem naming the parameter path.
    RegistrationError: a problem that stops the scan itself (no loss tag, a malformed tag, ...).

  Example:
    >>> kfac_jax.check_registration(loss_fn, params, batch)  # raises listing every problem
  """
  reg = _registration.shared(
    registration, loss_fn, "check_registration", ("params", params), ("batch", batch)
  )
  axis_name, has_aux, layers = None, False, None
  if reg is not None:
    loss_fn, params, batch = reg.loss_fn, reg.params_shape, reg.example_batch
    axis_name, has_aux, layers = reg.collective_axes, reg.has_aux, reg.layer_config
  part = _registration.LossPart(loss_fn, has_aux)
  with _compat.axis_env([(n, 1) for n in _registration.axis_names(axis_name)]):
    scan = _tracer.scan(
      part, params, batch, has_aux=has_aux, warn=False, layers=layers, collect=True
    )
  return scan.layers


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
    kind += "" if s.source == "auto" else f" ({s.source})"
    approx = s.approx if s.block is None else s.block.__name__
    common = len(os.path.commonprefix([p.split("/")[:-1] for p in s.param_paths]))
    paths = ", ".join("/".join(p.split("/")[common:]) for p in s.param_paths)  # kernel, bias
    row = (s.name, kind, str(s.num_uses), approx, paths, shapes)
    rows.append(row + (format_bytes(nbytes), s.note))
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
