"""Every JAX-internal name kfac_jax uses, in one place.

A JAX upgrade that moves or changes an internal API should only need edits here. Supported:
jax/jaxlib 0.10 (Python 3.11) and 0.11/0.12 (Python 3.12).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
from jax.extend import core as _jex_core
from jax.interpreters import ad, batching, mlir

Primitive = _jex_core.Primitive
ClosedJaxpr = _jex_core.ClosedJaxpr
Jaxpr = _jex_core.Jaxpr
JaxprEqn = _jex_core.JaxprEqn
Literal = _jex_core.Literal
Var = _jex_core.Var
DropVar = _jex_core.DropVar

# Symbolic zero tangents; pass-through JVP rules hand them on untouched.
Zero = ad.Zero

__all__ = [
  "ClosedJaxpr",
  "DropVar",
  "Jaxpr",
  "JaxprEqn",
  "Literal",
  "Primitive",
  "Var",
  "Zero",
  "ad",
  "axis_env",
  "axis_env_key",
  "batching",
  "bind_eqn",
  "call_jaxpr_of",
  "mlir",
  "remat_options",
  "transparent_jaxpr_of",
]

# Primitives that only call a closed sub-jaxpr with the same inputs and outputs (nested `jax.jit`,
# `closed_call`). The scanner and the tapped interpreter inline them; their semantics do not change.
_INLINE_CALL_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call"})


def bind_params(eqn: JaxprEqn) -> dict[str, Any]:
  """The keyword arguments with which `eqn.primitive.bind` re-creates `eqn`.

  `Primitive.get_bind_params` returned `(subfuns, params)` before jax 0.9.2 and returns only
  `params` since; both forms are accepted here.
  """
  out = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
    subfuns, params = out
    if subfuns:  # Old-style call primitives; never produced by the versions we support.
      raise NotImplementedError(f"cannot re-bind {eqn.primitive.name} with sub-functions")
    return params
  return out


# Set (by `pull_back_convs_canonically`) while tracing a pass that is only pulled back, never
# pushed forward: the curvature statistics of `CurvatureEstimator.curvature_stats`.
_CANONICAL_CONV_PULL_BACK: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "kfac_jax_canonical_conv_pull_back", default=False
)


@contextlib.contextmanager
def pull_back_convs_canonically():
  """Within this block, `bind_eqn` evaluates convolutions through
  `_conv_input_transpose_canonical` (the same values; a pull-back that stays fast inside
  `lax.cond` on CPU, a push-forward that does not: use it for passes that are only pulled
  back)."""
  token = _CANONICAL_CONV_PULL_BACK.set(True)
  try:
    yield
  finally:
    _CANONICAL_CONV_PULL_BACK.reset(token)


def bind_eqn(eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
  """Evaluates one equation on `invals` (arrays or tracers), returning a list of outputs.

  Under `pull_back_convs_canonically`, convolutions go through
  `_conv_input_transpose_canonical`."""
  params = bind_params(eqn)
  if (
    eqn.primitive.name == "conv_general_dilated"
    and _CANONICAL_CONV_PULL_BACK.get()
    and params.get("batch_group_count", 1) == 1
  ):
    return [_conv_input_transpose_canonical(params, *invals)]
  ans = eqn.primitive.bind(*invals, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def _conv_input_transpose_canonical(params: dict[str, Any], x, w):
  """`conv_general_dilated(x, w, **params)` whose derivative in `x` is written with the kernel's
  feature axes swapped in memory (`rhs_spec` adjusted: the same convolution).

  JAX transposes a convolution in its input by a convolution of the kernel read with its input
  and output feature axes exchanged. XLA's CPU backend re-lays that kernel out where it is free
  to, but not inside a `lax.cond` branch or a loop body, where the convolution then runs
  through a generic, much slower loop (the transforms' statistics pull back inside a cond).
  Written against the swapped kernel, the transposed convolution reads it in the canonical
  order, fast in either place. The forward value and the kernel's derivative are the plain
  convolution's. The input tangent's push-forward is then the convolution with the swapped
  kernel, the slow form inside a cond (the `Optimizer`'s quadratic model): hence only for
  passes that are pulled back (`pull_back_convs_canonically`)."""
  conv = jax.lax.conv_general_dilated_p

  @jax.custom_jvp
  def f(x, w):
    return conv.bind(x, w, **params)

  @f.defjvp
  def f_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    dn = params["dimension_numbers"]
    o, i = dn.rhs_spec[0], dn.rhs_spec[1]
    swapped = dict(params, dimension_numbers=dn._replace(rhs_spec=(i, o, *dn.rhs_spec[2:])))
    w_swapped = jax.numpy.swapaxes(w, o, i)
    out = conv.bind(x, w, **params)
    return out, conv.bind(dx, w_swapped, **swapped) + conv.bind(x, dw, **params)

  return f(x, w)


def call_jaxpr_of(eqn: JaxprEqn) -> ClosedJaxpr | None:
  """The closed sub-jaxpr of an inlinable call equation (nested jit), else None."""
  if eqn.primitive.name not in _INLINE_CALL_NAMES:
    return None
  sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if sub is None:
    return None
  if isinstance(sub, ClosedJaxpr):
    return sub
  return ClosedJaxpr(sub, ())


# Primitives that evaluate a sub-jaxpr under a differentiation rule of their own: rematerialisation
# (`jax.checkpoint`, linen `nn.remat`, `nnx.remat`) and custom derivatives (`jax.custom_jvp`,
# `jax.custom_vjp`). `_graph.FlatGraph` inlines them when they read a parameter (see there).
REMAT_NAMES = frozenset({"checkpoint", "remat", "remat2"})
CUSTOM_DERIVATIVE_NAMES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def transparent_jaxpr_of(eqn: JaxprEqn) -> tuple[ClosedJaxpr, str] | None:
  """`(closed sub-jaxpr, "remat" | "custom")` for a remat or custom-derivative equation whose
  sub-jaxpr takes exactly the equation's inputs and gives its outputs; else None."""
  name = eqn.primitive.name
  if name in REMAT_NAMES:
    kind = "remat"
  elif name in CUSTOM_DERIVATIVE_NAMES:
    kind = "custom"
  else:
    return None
  sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
  if sub is None:
    return None
  if not isinstance(sub, ClosedJaxpr):
    sub = ClosedJaxpr(sub, ())
  if len(sub.jaxpr.invars) != len(eqn.invars) or len(sub.jaxpr.outvars) != len(eqn.outvars):
    return None
  return sub, kind


def remat_options(eqn: JaxprEqn) -> dict[str, Any]:
  """The `jax.checkpoint` keyword arguments a remat equation was built with."""
  return {"policy": eqn.params.get("policy"), "prevent_cse": eqn.params.get("prevent_cse", True)}


def make_jaxpr(fun, *args) -> tuple[ClosedJaxpr, Any]:
  """`jax.make_jaxpr(fun, return_shape=True)(*args)`: the closed jaxpr and the output's pytree
  of ShapeDtypeStructs; the arguments may be arrays, tracers or ShapeDtypeStructs."""
  return jax.make_jaxpr(fun, return_shape=True)(*args)


def axis_env(axes):
  """A context binding named axes `[(name, size), ...]` while tracing, as `jax.make_jaxpr(...,
  axis_env=axes)` does: collectives (`psum`, `pmean`) over them trace outside pmap/shard_map.
  Names that are already bound are left as they are."""
  from jax._src import core as _core

  axes = list(axes)
  try:  # Names already bound (inside pmap / shard_map) keep their real size.
    env = _core.get_axis_env()
    axes = [(n, s) for n, s in axes if not env.axis_exists(n)]
  except AttributeError:  # pragma: no cover - older/newer private API: bind them all.
    pass
  return _core.extend_axis_env_nd(axes)


def axis_env_key() -> tuple | None:
  """The named axes bound right now, as a hashable `((name, size), ...)`; None when the private
  API is unavailable (callers then assume nothing about the environment)."""
  from jax._src import core as _core

  try:
    sizes = _core.get_axis_env().axis_sizes
  except AttributeError:  # pragma: no cover - older/newer private API.
    return None
  return tuple(sorted(((str(n), n, s) for n, s in sizes.items()), key=lambda t: t[0]))


def source_line(eqn: JaxprEqn, skip_dir: str) -> str | None:
  """`file:line` of the innermost user frame that created `eqn`, frames under `skip_dir` (the
  library's own) skipped; None when JAX kept no traceback."""
  try:
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
  except Exception:  # noqa: BLE001 - a diagnostic only; an internal API that moved gives none.
    return None
  for frame in frames:
    if not frame.file_name.startswith(skip_dir):
      return f"{frame.file_name}:{frame.start_line}"
  return None
