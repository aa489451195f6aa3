"""Every JAX-internal name kfac_jax uses, in one place.

A JAX upgrade that moves or changes an internal API should only need edits here. Supported:
jax/jaxlib 0.10 (Python 3.11) and 0.11/0.12 (Python 3.12).
"""

from __future__ import annotations

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


def bind_eqn(eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
  """Evaluates one equation on `invals` (arrays or tracers), returning a list of outputs."""
  ans = eqn.primitive.bind(*invals, **bind_params(eqn))
  return list(ans) if eqn.primitive.multiple_results else [ans]


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


def make_jaxpr(fun, *args) -> ClosedJaxpr:
  """`jax.make_jaxpr(fun)(*args)`, accepting arrays, tracers or ShapeDtypeStructs."""
  return jax.make_jaxpr(fun)(*args)


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
