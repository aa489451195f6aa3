"""Every JAX-internal name kfac_jax uses, in one place, so a JAX upgrade needs edits only here.

Supported: jax/jaxlib 0.10 (Python 3.11) and 0.11/0.12 (Python 3.12).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from typing import Any

import jax
import threadpoolctl
from jax._src import core as _core
from jax._src.interpreters import partial_eval as _pe
from jax.extend import core as _jex_core
from jax.interpreters import ad as ad  # Re-exported, as are the names below.
from jax.interpreters import batching as batching
from jax.interpreters import mlir as mlir

Primitive = _jex_core.Primitive
ClosedJaxpr = _jex_core.ClosedJaxpr
JaxprEqn = _jex_core.JaxprEqn
Literal = _jex_core.Literal
subjaxprs = _jex_core.subjaxprs
has_effects = _pe.has_effects  # Whether an equation has an effect dead-code elimination keeps.

# Calls the scanner inlines; and sub-jaxprs under a differentiation rule of their own.
_INLINE_CALL_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call"})
_TRANSPARENT_KINDS = {
  **dict.fromkeys(("checkpoint", "remat", "remat2"), "remat"),
  **dict.fromkeys(("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"), "custom"),
}
_CANONICAL_CONV_PULL_BACK: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "kfac_jax_canonical_conv_pull_back", default=False
)


@contextlib.contextmanager
def pull_back_convs_canonically():
  """Within this block `bind_eqn` evaluates convolutions for passes only pulled back."""
  token = _CANONICAL_CONV_PULL_BACK.set(True)
  try:
    yield
  finally:
    _CANONICAL_CONV_PULL_BACK.reset(token)


def bind_eqn(eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
  """Evaluates one equation on `invals` (arrays or tracers), returning a list of outputs."""
  params = eqn.primitive.get_bind_params(eqn.params)
  if (
    eqn.primitive.name == "conv_general_dilated"
    and _CANONICAL_CONV_PULL_BACK.get()
    and params.get("batch_group_count", 1) == 1
  ):
    return [_conv_input_transpose_canonical(params, *invals)]
  ans = eqn.primitive.bind(*invals, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def _conv_input_transpose_canonical(params: dict[str, Any], x, w):
  """`conv_general_dilated(x, w, **params)` whose derivative in `x` reads the kernel with its
  feature axes swapped, so that its transpose reads it in the canonical order (which XLA's CPU
  backend needs inside a `lax.cond` or loop to avoid a slow generic loop)."""
  conv = jax.lax.conv_general_dilated_p

  @jax.custom_jvp
  def f(x, w):
    return conv.bind(x, w, **params)

  @f.defjvp
  def f_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    dn = params["dimension_numbers"]
    o, i = dn.rhs_spec[0], dn.rhs_spec[1]
    swapped = dict(params, dimension_numbers=dn._replace(rhs_spec=(i, o, *dn.rhs_spec[2:])))
    w_swapped = jax.numpy.swapaxes(w, o, i)
    out = conv.bind(x, w, **params)
    return out, conv.bind(dx, w_swapped, **swapped) + conv.bind(x, dw, **params)

  return f(x, w)


def _sub_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr | None:
  sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
  return sub if sub is None or isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, ())


def call_jaxpr_of(eqn: JaxprEqn) -> ClosedJaxpr | None:
  """The closed sub-jaxpr of an inlinable call equation (nested jit), else None."""
  return _sub_jaxpr(eqn) if eqn.primitive.name in _INLINE_CALL_NAMES else None


def transparent_jaxpr_of(eqn: JaxprEqn) -> tuple[ClosedJaxpr, str] | None:
  """`(closed sub-jaxpr, "remat" | "custom")` for a remat or custom-derivative equation whose
  sub-jaxpr takes exactly the equation's inputs and gives its outputs; else None."""
  kind = _TRANSPARENT_KINDS.get(eqn.primitive.name)
  sub = _sub_jaxpr(eqn) if kind else None
  if kind is None or sub is None:
    return None
  if len(sub.jaxpr.invars) != len(eqn.invars) or len(sub.jaxpr.outvars) != len(eqn.outvars):
    return None
  return sub, kind


def remat_options(eqn: JaxprEqn) -> dict[str, Any]:
  """The `jax.checkpoint` keyword arguments a remat equation was built with."""
  return {"policy": eqn.params.get("policy"), "prevent_cse": eqn.params.get("prevent_cse", True)}


def axis_env(axes):
  """A context binding named axes `[(name, size), ...]` while tracing, outside pmap."""
  axes = list(axes)
  try:  # Names already bound (inside pmap / shard_map) keep their real size.
    env = _core.get_axis_env()
    axes = [(n, s) for n, s in axes if not env.axis_exists(n)]
  except AttributeError:  # pragma: no cover - older/newer private API: bind them all.
    pass
  return _core.extend_axis_env_nd(axes)


def axis_env_key() -> tuple | None:
  """The named axes bound right now, hashable; None when the private API is unavailable."""
  try:
    sizes = _core.get_axis_env().axis_sizes
  except AttributeError:  # pragma: no cover - older/newer private API.
    return None
  return tuple(sorted(((str(n), n, s) for n, s in sizes.items()), key=lambda t: t[0]))


def source_frames(eqn: JaxprEqn, skip_dir: str) -> tuple[tuple[str, int, str], ...]:
  """`(file, line, function)` of the user frames that created `eqn` (not under `skip_dir`)."""
  try:
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
  except Exception:  # noqa: BLE001 - a diagnostic only; an internal API that moved gives none.
    return ()
  return tuple(
    (f.file_name, f.start_line, f.function_name)
    for f in frames
    if not f.file_name.startswith(skip_dir)
  )


def source_line(eqn: JaxprEqn, skip_dir: str) -> str | None:
  """`file:line in function` of the innermost frame of `source_frames`, or None."""
  for file, line, function in source_frames(eqn, skip_dir)[:1]:
    return f"{file}:{line} in {function}"
  return None


_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
_lapack_threads_set: list[bool] = []  # Non-empty once `one_lapack_thread` has run.


def one_lapack_thread() -> None:
  """On CPU, scipy's OpenBLAS set to one thread once per process (unless the environment names a
  BLAS thread count): jaxlib's LAPACK kernels call it, and its spinning workers starve XLA."""
  if _lapack_threads_set:
    return
  _lapack_threads_set.append(True)
  if any(os.environ.get(v) for v in _BLAS_THREAD_VARIABLES) or jax.default_backend() != "cpu":
    return
  lapack = importlib.import_module("scipy.linalg.cython_lapack")  # Loads scipy's OpenBLAS.
  site = os.path.dirname(os.path.dirname(os.path.dirname(lapack.__file__ or "")))
  scipy_libs = os.path.join(site, "scipy.libs")
  for lib in threadpoolctl.ThreadpoolController().select(internal_api="openblas").lib_controllers:
    if os.path.dirname(lib.filepath) == scipy_libs:
      lib.set_num_threads(1)
