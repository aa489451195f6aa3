"""The loss audit: do the loss tags describe the loss `L` that `loss_fn` returns?

K-FAC's curvature is that of the *tagged* loss `T = Σ_t (1/N) Σ_n w ℓ_t(z_t, y_t)`, not of `L`.
A `Registration` audits the tags once, on the example batch (docs/troubleshooting.rst): the
structure ("shared_prediction", "dependence": a `RegistrationError`), then, with `ε_t` added to
each prediction `z_t` (and every copy of its value; through `z` for a complex one), that
`∂²L/∂ε² v = c_t H_z T v` for a fixed probe `v` ("curvature"), in the "empirical" mode
`∂L/∂ε = c_t ∇_z T` ("gradient"), with one positive factor `c` for every tag ("weights").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _compat, _losses, _tags
from kfac_jax import scan as _scan
from kfac_jax._curvature import read_atom
from kfac_jax._errors import LossMismatchWarning, RegistrationError

_TOLERANCE = 1e-2  # Relative residual allowed in float32 / float64.
_SEED = 0  # The probe `v` is fixed: the audit gives the same verdict every time.
# Compiled once and run once: XLA's backend optimisations would cost more than they save.
_COMPILER_OPTIONS: dict[str, str | bool] = {
  "xla_backend_optimization_level": "0",
  "xla_llvm_disable_expensive_passes": True,
}

# The audit's checks, by the name `check_loss=` takes (module docstring).
CHECKS = ("shared_prediction", "dependence", "curvature", "gradient", "weights")
_MEASURED = frozenset({"curvature", "gradient", "weights"})
_SNAP = 1e-3  # Relative distance within which the loss factor is snapped to 1/k or k.


def checks_from(check_loss: Any) -> frozenset[str]:
  """The checks `check_loss` turns on: every one for True, none for False, else those named."""
  if isinstance(check_loss, (bool, np.bool_)):
    return frozenset(CHECKS) if check_loss else frozenset()
  if isinstance(check_loss, str) or not isinstance(check_loss, Iterable):
    raise TypeError(
      "`check_loss` must be True (every loss audit check), False (none) or a collection of "
      f"check names from {CHECKS}, got {check_loss!r}."
    )
  names = tuple(check_loss)
  bad = [n for n in names if n not in CHECKS]
  if bad:
    raise ValueError(
      f"`check_loss` names unknown loss audit checks {bad}; the checks are {CHECKS}."
    )
  return frozenset(names)


def switch(check: str, checks: frozenset[str] = frozenset(CHECKS)) -> str:
  """`[check "X"; ...]`: the check's name and the `check_loss=` that turns it off alone."""
  others = tuple(c for c in CHECKS if c in checks and c != check)
  return (
    f'[loss audit check "{check}"; `kfac_jax.Registration(..., check_loss={others!r})` turns '
    "it off alone, `check_loss=False` the whole audit]"
  )


CAUSES = (
  "Common causes and their fixes: docs/troubleshooting.rst. If the curvature is another "
  "function's on purpose, give that function as `Registration(..., curvature_fn=...)`; for "
  "another deliberate difference, build the registration with `check_loss=False`."
)


# What may stand between a complex prediction's parts and the stack the tag takes.
_PASS_THROUGH = frozenset({"broadcast_in_dim", "reshape", "expand_dims"})


def complex_source(graph: _scan.FlatGraph, atom) -> Any:
  """The complex value `z` whose parts `stack([real(z), imag(z)], -1)` are the tagged
  prediction `atom` (a normal tag on a complex mean), else None."""
  made = {k: fe for fe in graph.eqns for k in fe.outs}
  value = values(graph)

  def part(a):
    fe = made.get(a) if _scan.is_key(a) else None
    while fe is not None and fe.name in _PASS_THROUGH and len(fe.ins) == 1:
      fe = made.get(fe.ins[0]) if _scan.is_key(fe.ins[0]) else None
    return (fe.name, value.get(fe.ins[0], fe.ins[0])) if fe is not None and fe.ins else None

  fe = made.get(atom) if _scan.is_key(atom) else None
  if fe is None or fe.name not in ("stack", "concatenate") or len(fe.ins) != 2:
    return None
  re, im = part(fe.ins[0]), part(fe.ins[1])
  if re is None or im is None or (re[0], im[0]) != ("real", "imag") or re[1] != im[1]:
    return None
  return re[1]


def check_structure(scan, checks: frozenset[str] = frozenset(CHECKS)) -> None:
  """RegistrationError for two tags on one prediction ("shared_prediction") or a tag the loss
  does not depend on ("dependence"), each where `checks` holds it."""
  graph = scan.graph
  tags = [fe for fe in graph.eqns if fe.eqn.primitive is _tags.loss_tag_p]
  names, value = _scan.tag_names(graph), values(graph)
  tag_input = {fe.outs[0]: fe.ins[0] for fe in tags}  # A tag's output is its prediction.
  first: dict = {}
  for i, fe in enumerate(tags if "shared_prediction" in checks else ()):
    atom = fe.ins[0]
    while _scan.is_key(atom) and atom in tag_input:
      atom = tag_input[atom]
    if not _scan.is_key(atom):
      continue
    atom = value.get(atom, atom)
    if atom in first:
      raise RegistrationError(
        f"{names[first[atom]]} and {names[i]} tag the same prediction: its curvature would be "
        "counted twice (K-FAC sums the curvatures of the tags). Register each model output "
        f"with one loss tag. {switch('shared_prediction', checks)}"
      )
    first[atom] = i
  const_keys = {k for k, _ in graph.consts}
  for i, fe in enumerate(tags if "dependence" in checks else ()):
    atom = fe.ins[0]
    if not _scan.is_key(atom) or atom in const_keys:
      continue
    atom = complex_source(graph, atom) or atom
    if not _reaches(graph, value, atom, graph.outvars[0]):
      raise RegistrationError(
        f"{names[i]}: the loss loss_fn returns does not depend on this prediction (no path, or "
        "only through stop_gradient): K-FAC would use the curvature of a loss not trained. Tag "
        "the value the loss is computed from. For another function's curvature (variational Monte "
        "Carlo: log|psi|), move the tag there, pass `Registration(..., curvature_fn=log_psi_fn)`"
        f", or tag inside the loss's jax.custom_jvp rule. {switch('dependence', checks)}"
      )


def check_overridden_tags(scan, loss_fn, params, batch, *, strict: bool, warn: bool) -> None:
  """Reports (`_report`) the loss tags `loss_fn` binds itself when `scan` is a `curvature_fn`'s."""
  if not (strict or warn):
    return
  closed = jax.make_jaxpr(loss_fn)(params, batch)
  ignored = _scan.tag_names(_scan.FlatGraph.from_closed_jaxpr(closed))
  if not ignored:
    return
  text = (
    f"`loss_fn` has its own loss tag(s), {'; '.join(ignored)}, and the registration has a "
    "`curvature_fn`: the curvature is that of `curvature_fn`'s tags, "
    f"{'; '.join(_scan.tag_names(scan.graph))}, and `loss_fn`'s are not read. Remove them from "
    "`loss_fn`, or drop `curvature_fn` to use them. `check_loss=False` skips this check."
  )
  _report(text, strict)


def _report(text: str, strict: bool) -> None:
  """`text` as a RegistrationError with `strict`, else as a `LossMismatchWarning`."""
  if strict:
    raise RegistrationError(text + " (strict=True turns this into an error.)")
  warnings.warn(text, LossMismatchWarning, stacklevel=5)


def values(graph: _scan.FlatGraph) -> dict:
  """Key → the first key holding the same value (the same primitive, parameters and inputs)."""
  out: dict = {}
  made: dict = {}
  for fe in graph.eqns:
    sig: Any = None
    if not getattr(fe.eqn, "effects", None):  # An equation with effects is its own.
      try:
        ins = tuple(_frozen(a) if isinstance(a, _compat.Literal) else out.get(a, a) for a in fe.ins)
        sig = (fe.name, _frozen(fe.params), ins)
        hash(sig)
      except TypeError:  # A parameter that cannot be compared by value: its own too.
        sig = None
    first = made.setdefault(sig, fe.outs) if sig is not None else fe.outs
    for k, f in zip(fe.outs, first):
      out[k] = out.get(f, f)
  return out


def _frozen(x) -> Any:
  """`x` hashable by value (literals and arrays by their bytes, containers recursively)."""
  if isinstance(x, _compat.Literal):
    x = np.asarray(x.val)
  if isinstance(x, np.ndarray):
    return ("array", x.dtype.str, x.shape, x.tobytes())
  if isinstance(x, (list, tuple)):
    return (type(x).__name__,) + tuple(_frozen(y) for y in x)
  if isinstance(x, dict):
    return ("dict",) + tuple((k, _frozen(v)) for k, v in sorted(x.items(), key=lambda kv: kv[0]))
  return x


def _reaches(graph: _scan.FlatGraph, value: dict, start, target) -> bool:
  """Whether `target` depends on the value of `start` through the graph (not stop_gradient)."""
  if not _scan.is_key(target):
    return False
  reached = {value.get(start, start)}
  for fe in graph.eqns:
    if fe.name == "stop_gradient":
      continue
    if any(_scan.is_key(a) and value.get(a, a) in reached for a in fe.ins):
      reached.update(value.get(k, k) for k in fe.outs)
  return value.get(target, target) in reached


def stand_ins(tree, seed: int):
  """`tree` with every leaf that is not concrete replaced by a fixed numpy array: a normal draw
  over √fan-in for floats of rank ≥ 2, ones for other floats and bools, zeros for integers."""
  rng = np.random.default_rng(seed)
  concrete = (jax.Array, np.ndarray, np.generic, int, float, bool)

  def one(x):
    if isinstance(x, concrete) and not isinstance(x, jax.core.Tracer):
      return x
    shape, dtype = tuple(np.shape(x)), jnp.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
      if len(shape) < 2:
        return np.ones(shape, dtype)
      draw = rng.standard_normal(shape) / math.sqrt(math.prod(shape[:-1]))
      return np.asarray(draw).astype(dtype)
    if dtype == jnp.bool_:
      return np.ones(shape, bool)
    return np.zeros(shape, dtype)

  return jax.tree_util.tree_map(one, tree)


def has_tracer_consts(scan: _scan.ScanResult) -> bool:
  """Whether the traced `loss_fn` closes over values of an enclosing trace."""
  return any(isinstance(v, jax.core.Tracer) for _, v in scan.graph.consts)


def measure(scan, params, batch, axis_names: Sequence[str] = ()):
  """Per tag, float64 numpy `(∂L/∂ε, ∂²L/∂ε² v, H_z T v, ∇_z T or None)`, at the example point
  (None for a constant prediction), `axis_names` bound with size 1."""
  graph, operands = scan.graph, scan.loss_operands
  const_keys = {k for k, _ in graph.consts}
  live = [i for i, ops in enumerate(operands) if _scan.is_key(ops[0]) and ops[0] not in const_keys]
  keys = [operands[i][0] for i in live]
  in_scan = graph.scan_positions
  # A complex mean's parts are perturbed through the complex value (`complex_source`).
  sources = [None if k in in_scan else complex_source(graph, k) for k in keys]
  targets = [k if z is None else z for k, z in zip(keys, sources)]
  # Every copy of a prediction (module docstring) takes its perturbation too.
  value = values(graph)
  same: dict = {}
  for k, v in value.items():
    same.setdefault(v, []).append(k)
  copies = [
    [c for c in same.get(value.get(k, k), []) if k not in in_scan and c != k and c not in in_scan]
    for k in targets
  ]
  watch = frozenset(a for ops in scan.loss_operands for a in ops if _scan.is_key(a))
  watch = watch | {c for cs in copies for c in cs} | {z for z in sources if z is not None}
  rng = np.random.default_rng(_SEED)
  # NumPy probes: a registration built inside a traced step must not make them its tracers.
  probes = [np.asarray(rng.standard_normal(k[1].aval.shape)).astype(k[1].aval.dtype) for k in keys]
  flat = jax.tree_util.tree_leaves(params) + jax.tree_util.tree_leaves(batch)

  # Scans run as scans unless a tag's operand is made inside one (then step by step).
  unroll = any(k in in_scan for k in watch)

  def run(flat, probes):
    def loss_at(eps):
      perturb: dict = {}
      for k, z, cs, e in zip(targets, sources, copies, eps):
        if z is not None:  # `ε_re + i ε_im` on the complex value.
          e = jax.lax.complex(e[..., 0], e[..., 1])
        for c in (k, *cs):  # A value two tags share takes both perturbations.
          perturb[c] = perturb[c] + e if c in perturb else e
      outs, seen = graph.evaluate(flat, perturb, watch, unroll=unroll)
      ops = [tuple(read_atom(a, seen) for a in o) for o in scan.loss_operands]
      return outs[0], ops

    eps0 = [jnp.zeros_like(p) for p in probes]
    g_loss, h_loss, ops = jax.jvp(jax.grad(loss_at, has_aux=True), (eps0,), (probes,), has_aux=True)
    h_tag, g_tag = [], []
    for n, i in enumerate(live):
      spec = scan.losses[i]
      h_tag.append(_losses.output_curvature_product(spec, ops[i], probes[n]))
      g_tag.append(_losses.output_gradient(spec, ops[i]) if spec.has_targets else None)
    return g_loss, h_loss, h_tag, g_tag

  fn = run
  for name in axis_names:  # Collectives over a bound axis of size 1.
    fn = _bound(fn, name)
  # One program (under `ensure_compile_time_eval` each operation would compile on its own); only
  # the call runs eagerly, so that inside an enclosing trace the numbers are concrete.
  compiled = jax.jit(fn).lower(flat, probes).compile(_COMPILER_OPTIONS)
  with jax.ensure_compile_time_eval():
    g_loss, h_loss, h_tag, g_tag = compiled(flat, probes)
  out: list = [None] * len(scan.losses)
  for n, i in enumerate(live):
    out[i] = (_as64(g_loss[n]), _as64(h_loss[n]), _as64(h_tag[n]), _as64(g_tag[n]))
  return out


def _as64(x):
  return None if x is None else np.asarray(x, np.float64).ravel()


def _bound(fn, name):
  def wrapped(*args):
    outs = jax.vmap(lambda: fn(*args), axis_size=1, axis_name=name)()
    return jax.tree_util.tree_map(lambda x: x[0], outs)

  return wrapped


def tolerance(dtype) -> float:
  """The relative residual allowed for predictions of `dtype` (looser in 16-bit formats)."""
  return max(_TOLERANCE, 10 * float(jnp.finfo(dtype).eps))


def _fit(a, b):
  """`(c, ‖a − c b‖ / ‖a‖)` for the least-squares `c`; None when both vanish."""
  na, nb = np.linalg.norm(a), np.linalg.norm(b)
  if nb == 0:
    return None if na == 0 else (np.inf, 1.0)
  c = float(a @ b) / float(b @ b)
  return c, (float(np.linalg.norm(a - c * b) / na) if na > 0 else 1.0)


def loss_factor(numbers) -> float | None:
  """`c` (`L ≈ c T`) from `measure`'s numbers: the tags' mean positive factor, else None."""
  fits = [_fit(entry[1], entry[2]) for entry in numbers if entry is not None]
  cs = [fit[0] for fit in fits if fit is not None and np.isfinite(fit[0]) and fit[0] > 0]
  return snap(float(np.mean(cs))) if cs else None


def snap(c: float) -> float:
  """`c` as `1/k` or `k` where it is one within `_SNAP`, else to 3 significant digits, so the
  factor measured at two points (the params, or stand-ins) agrees."""
  for k, value in ((round(1 / c), 1 / max(round(1 / c), 1)), (round(c), float(round(c)))):
    if k >= 1 and abs(c / value - 1) <= _SNAP:
      return value
  return float(f"{c:.3g}")


def problems(
  scan, numbers, estimation_mode: str, checks: frozenset[str] = frozenset(CHECKS)
) -> list[str]:
  """The audit's findings for `checks` from `measure`'s numbers, each ending with its `switch`."""
  names = _scan.tag_names(scan.graph)
  found: list[str] = []
  factors: list[tuple[int, float]] = []

  def add(check: str, text: str) -> None:
    if check in checks:
      found.append(f"{text} {switch(check, checks)}")

  for i, entry in enumerate(numbers):
    fit = None if entry is None else _fit(entry[1], entry[2])
    if fit is None:  # No curvature on either side at this point (saturated): nothing to say.
      continue
    (g_loss, h_loss, _, g_tag), (c, r) = entry, fit
    tol = tolerance(_scan.aval_of(scan.loss_operands[i][0]).dtype)
    kind = scan.losses[i].kind
    if not np.isfinite(c):
      text = (
        f"the tagged {kind} loss has no curvature at the example batch, but the returned loss has"
      )
    elif np.linalg.norm(h_loss) == 0:
      text = (
        "the returned loss has no curvature in this prediction at the example batch (its "
        f"Hessian-vector product is zero), the tagged {kind} loss has"
      )
    elif c <= 0:
      text = (
        f"the returned loss's curvature in this prediction is the tagged {kind} loss's times a "
        f"negative factor ({c:.3g})"
      )
    elif r > tol:
      text = (
        "the returned loss's curvature in this prediction differs from the tagged "
        f"{kind} loss's by a relative {r:.3g} after the best constant factor {c:.3g} "
        f"(tolerance {tol:.3g})"
      )
    else:
      factors.append((i, c))
      if estimation_mode != "empirical" or g_tag is None:
        continue
      scale = max(np.linalg.norm(g_loss), np.linalg.norm(c * g_tag))
      rel = float(np.linalg.norm(g_loss - c * g_tag) / scale) if scale > 0 else 0.0
      if rel > tol:
        text = (
          "the returned loss's gradient in this prediction differs from the tagged "
          f"{kind} loss's (with its targets and weights, times {c:.3g}) by a relative {rel:.3g} "
          f"(tolerance {tol:.3g}); pass the tag the targets the loss uses (smoothed labels, say)"
        )
        add("gradient", f"{names[i]}: {text}")
      continue
    add("curvature", f"{names[i]}: {text}")
  if len(factors) > 1:
    cs = np.array([c for _, c in factors])
    tol = min(tolerance(_scan.aval_of(scan.loss_operands[i][0]).dtype) for i, _ in factors)
    if cs.max() / cs.min() - 1 > tol:
      listed = ", ".join(f"{c:.3g} for {names[i]}" for i, c in factors)
      text = (
        "the tags are weighted differently in the returned loss than in the tagged loss (the "
        f"factor, returned over tagged curvature: {listed}); give them `weight`s in its proportions"
      )
      add("weights", text)
  return found


def audit(
  scan,
  params,
  batch,
  *,
  estimation_mode: str,
  axis_names: Sequence[str] = (),
  strict: bool = False,
  warn: bool = True,
  checks: frozenset[str] = frozenset(CHECKS),
) -> float | None:
  """Runs the audit's `checks` on a scan of the example batch: the loss factor `c`, or None
  without a fit. RegistrationError: a failed structural check, or with `strict` a mismatch."""
  check_structure(scan, checks)
  if not (strict or warn) or not checks & _MEASURED or has_tracer_consts(scan):
    return None
  params, batch = stand_ins(params, _SEED + 1), stand_ins(batch, _SEED + 2)
  try:
    numbers = measure(scan, params, batch, axis_names)
  except Exception as e:  # noqa: BLE001 - the audit must not stop a loss that trains.
    if warn:
      warnings.warn(
        "the loss audit could not evaluate the loss's second derivative in the tagged predictions "
        f"({type(e).__name__}: {e}); `check_loss=False` skips the audit without this warning.",
        LossMismatchWarning,
        stacklevel=4,
      )
    return None
  found = problems(scan, numbers, estimation_mode, checks)
  if found:
    text = (
      "the loss tags do not describe the loss loss_fn returns, measured on the example batch: "
      + "; ".join(found)
      + ". K-FAC's curvature is then that of another loss than the one trained. "
      + CAUSES
    )
    _report(text, strict)  # `strict or warn` holds here.
    return None
  return loss_factor(numbers)
