"""Where a K-FAC step's compile time goes: its program by source region, and its compile time
with each candidate part removed or replaced.

Two reports for one workload and front (`benchmarks/compile_time.py`'s builders):

* regions: the compiled step's kernels (the instructions of the optimized HLO that XLA emits
  code for: fusions, custom calls, copies, ...), counted by the innermost `kfac_jax` function
  that emitted them (`module.function`), or `optax` / `model / step` outside the library.
  XLA:CPU's compile time grows with the kernel count (about 10 ms each);
* variants: seconds of `lower().compile()` for the step as built and with each variant
  applied, in one process, rounds interleaved with Adam's step (`jax.clear_caches()` before
  each compile), the minimum over `--repeats` rounds. A variant patches the library for the
  duration of its compile (a profile, not a supported setting): removing a check shows its
  cost, replacing a `lax.cond` by a select of both branches shows the cost of the cond itself.

The variants patch the library's internals by name (`--list` prints them with their indices);
one whose target is gone is reported as skipped.

    python benchmarks/profile/compile_parts.py --workload autoencoder --quick --front kfac
    python benchmarks/profile/compile_parts.py --workload cnn --front optimizer --variants 1,7
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import compile_time  # noqa: E402
from kfac_jax import _curvature, _engine, _estimator, _storage  # noqa: E402
from kfac_jax.blocks import _base, _linalg  # noqa: E402

_PKG = os.path.dirname(os.path.abspath(kfac_jax.__file__))


# -- kernels and regions ------------------------------------------------------------------------

_TRIVIAL = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
# Library wrappers that run a function unchanged: their kernels are their caller's.
_PASS_THROUGH = ("explicit_axes_as_auto", "vdot")


def _tables(text: str) -> tuple[dict, dict, dict, dict]:
  """The optimized HLO's source tables: file names, function names, locations
  `(file id, function id)` and stack frames `(location id, parent frame id or 0)`."""
  tables: dict[str, dict] = {}
  part = None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      part = tables.setdefault(line, {})
      continue
    if not line.strip() or line.startswith(("HloModule", "%", "ENTRY", "}")):
      part = None if not line.strip() else part
      continue
    if part is not None:
      key, _, rest = line.partition(" ")
      part[int(key)] = rest.strip().strip('"')
  locs = {
    k: tuple(int(x) for x in re.findall(r"(?:file_name_id|function_name_id)=(\d+)", v))
    for k, v in tables.get("FileLocations", {}).items()
  }
  frames = {
    k: tuple(int(x) for x in re.findall(r"(?:file_location_id|parent_frame_id)=(\d+)", v))
    for k, v in tables.get("StackFrames", {}).items()
  }
  return tables.get("FileNames", {}), tables.get("FunctionNames", {}), locs, frames


def kernels(text: str) -> collections.Counter:
  """The kernels of a compiled program (its optimized HLO text): the instructions XLA emits
  code for (fusions, custom calls, copies, dots, ...: not those inside a fusion or a reducer),
  counted by the innermost `kfac_jax` function they come from (`module.function`), or
  `optax` / `model / step` outside the library. XLA:CPU's compile time grows with this count."""
  files, funcs, locs, frames = _tables(text)
  comps: dict[str, list[str]] = {}
  cur = None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
    if m:
      cur = comps.setdefault(m.group(1), [])
    elif line.startswith("}"):
      cur = None
    elif cur is not None and " = " in line:
      cur.append(line)
  inner = {
    n
    for lines in comps.values()
    for ln in lines
    for n in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", ln)
  }

  def region(frame: int) -> str:
    seen = []
    while frame and frame in frames and len(seen) < 64:
      loc, parent = frames[frame]
      fid, nid = locs.get(loc, (0, 0))
      seen.append((files.get(fid, ""), funcs.get(nid, "")))
      frame = parent - 1 if parent - 1 != frame else 0
    for f, name in seen:
      if f.startswith(_PKG) and name not in _PASS_THROUGH:
        mod = os.path.relpath(f, _PKG)[:-3].replace(os.sep, ".")
        return f"{mod}.{name.split('.<locals>')[0]}"
    if any(f"{os.sep}optax{os.sep}" in f for f, _ in seen):
      return "optax"
    return "model / step"

  out: collections.Counter = collections.Counter()
  for name, lines in comps.items():
    if name in inner:
      continue
    for ln in lines:
      op = re.search(r" = (?:\([^=]*\)|\S+) ([\w\-]+)\(", ln)
      if op is None or op.group(1) in _TRIVIAL:
        continue
      frame = re.search(r"stack_frame_id=(\d+)", ln)
      called = re.search(r"calls=%([\w.\-]+)", ln)
      if frame is None and called:  # A fusion named after none: its instructions' origin.
        frame = next(
          (f for f in map(re.compile(r"stack_frame_id=(\d+)").search, comps[called.group(1)]) if f),
          None,
        )
      if frame is not None:
        out[region(int(frame.group(1)))] += 1
      else:
        out[f"(no source: {op.group(1)}, XLA's)"] += 1
  return out


# -- variants -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(*triples):
  old = [(obj, name, getattr(obj, name)) for obj, name, _ in triples]
  for obj, name, value in triples:
    setattr(obj, name, value)
  try:
    yield
  finally:
    for obj, name, value in old:
      setattr(obj, name, value)


def _select_conds(*callers):
  """`jax.lax.cond` called from a function named in `callers` becomes a select between both
  branches' results (both computed): the cond's own cost, its branches kept."""
  real = jax.lax.cond

  def cond(pred, true_fn, false_fn, *operands, **kw):
    if sys._getframe(1).f_code.co_name in callers:  # noqa: SLF001
      a, b = true_fn(*operands), false_fn(*operands)
      return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)
    return real(pred, true_fn, false_fn, *operands, **kw)

  return _patched((jax.lax, "cond", cond))


def _finite_from(func_names):
  """`_storage.all_finite` returns True when called from a function named in `func_names`."""
  real = _storage.all_finite

  def all_finite(tree):
    if sys._getframe(1).f_code.co_name in func_names:  # noqa: SLF001
      return jnp.asarray(True)
    return real(tree)

  return _patched((_storage, "all_finite", all_finite))


def _vjp_linearisation():
  """`Linearisation` pulling back with `jax.vjp` instead of `jax.linear_transpose` of
  `jax.linearize`'s tangent map."""
  real_linearize = jax.linearize
  store = {}

  def linearize(f, *primals, has_aux=False):
    out, vjp_fn, aux = jax.vjp(f, *primals, has_aux=True)
    store["vjp"] = vjp_fn
    _, jvp_fn, _ = real_linearize(f, *primals, has_aux=True)
    return out, jvp_fn, aux

  def linear_transpose(fn, *primals):
    vjp_fn = store.pop("vjp")
    return lambda ct: vjp_fn(ct)

  return _patched(
    (_curvature.jax, "linearize", linearize), (jax, "linear_transpose", linear_transpose)
  )


_Est = _estimator.CurvatureEstimator


def _fused_all_finite(tree):
  """One `isfinite` on the sum of every leaf's sum (instead of one per leaf, stacked)."""
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  sums = [jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32)) for x in leaves]
  return jnp.isfinite(sum(sums[1:], sums[0]))


def _all_checks():
  stack = contextlib.ExitStack()
  stack.enter_context(_patched((_engine, "inputs_ok", lambda *a, **k: jnp.asarray(True))))
  stack.enter_context(
    _patched(
      (_storage, "_keep_finite", lambda new, old, keys: (new, jnp.zeros((len(keys),), bool)))
    )
  )
  stack.enter_context(_finite_from(("_fold", "step", "_finish")))
  return stack


def _no_refresh(self, state, *args):
  """The estimator's refresh replaced by its input state, no block flagged."""
  return state, jnp.zeros((len(self.names),), bool)


VARIANTS = {
  "as built": (lambda: contextlib.nullcontext(), None),
  "with the warnings' host callbacks (`Config(step_warnings=True)`)": (
    lambda: contextlib.nullcontext(),
    {"step_warnings": True},
  ),
  "no input check (`_engine.inputs_ok` True)": (
    lambda: _patched((_engine, "inputs_ok", lambda *a, **k: jnp.asarray(True))),
    None,
  ),
  "no statistics check (estimator's `all_finite` True)": (
    lambda: _finite_from(("_fold",)),
    None,
  ),
  "no check of the preconditioned update (`all_finite(pre)`)": (
    lambda: _finite_from(("step", "_finish")),
    None,
  ),
  "no per-block cache check (`_storage._keep_finite` keeps all)": (
    lambda: _patched(
      (_storage, "_keep_finite", lambda new, old, keys: (new, jnp.zeros((len(keys),), bool)))
    ),
    None,
  ),
  "every finiteness check removed (all of the above)": (_all_checks, None),
  "guard off (`Config(skip_nonfinite=False)`)": (
    lambda: contextlib.nullcontext(),
    {"skip_nonfinite": False},
  ),
  "per-block cache check: select, not cond": (lambda: _select_conds("_keep_finite"), None),
  "statistics check: select, not cond": (
    lambda: _select_conds("_fold"),
    None,
  ),
  "schedule conds (fold, refresh, burn-in): select": (lambda: _select_conds("step"), None),
  "kfac chain's guard cond: select": (lambda: _select_conds("update_fn"), None),
  "Optimizer conds (adaptation, burn-in, finish): select": (
    lambda: _select_conds("_move", "_update", "_finish"),
    None,
  ),
  "`all_finite`: one isfinite on the sum of the leaves' sums": (
    lambda: _patched((_storage, "all_finite", _fused_all_finite)),
    None,
  ),
  "traces for pi by `jnp.sum`, not `_linalg.ordered_sum`'s tree": (
    lambda: _patched((_linalg, "ordered_sum", lambda x: jnp.sum(x, axis=-1))),
    None,
  ),
  "stage removed: the refresh (the estimator's `_refresh_flagged` returns its state)": (
    lambda: _patched((_Est, "_refresh_flagged", _no_refresh)),
    None,
  ),
  "stage removed: the fold (the estimator's `_fold` returns its state)": (
    lambda: _patched((_Est, "_fold", lambda self, state, *a, **k: state)),
    None,
  ),
  "stage removed: the products (the estimator's `_power` returns the vector)": (
    lambda: _patched((_Est, "_power", lambda self, state, v, *a, **k: v)),
    None,
  ),
  "pull-back by jax.vjp (not linearize + linear_transpose)": (_vjp_linearisation, None),
  "equal-shape blocks refreshed in one vmap": (
    lambda: _patched((_base, "batched_factorisations", lambda: True)),
    None,
  ),
}


def measure(fn, args) -> tuple[float, float, float, int]:
  """`(trace + lower seconds, compile seconds, compile CPU seconds, kernels)` after
  `jax.clear_caches()`."""
  jax.clear_caches()
  t0 = time.perf_counter()
  lowered = jax.jit(fn, donate_argnums=(0, 1)).trace(*args).lower()
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  return t1 - t0, t2 - t1, c2 - c1, sum(kernels(compiled.as_text()).values())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", default="autoencoder")
  p.add_argument("--front", default="kfac", choices=compile_time.FRONTS[1:])
  p.add_argument("--quick", action="store_true", help="the race workloads' small models")
  p.add_argument("--repeats", type=int, default=2, help="rounds (minimum kept)")
  p.add_argument("--regions", type=int, default=25, help="regions listed (0: no region table)")
  p.add_argument(
    "--variants", default="all", help="comma-separated indices into the variant list, or all"
  )
  p.add_argument("--list", action="store_true", help="print the variants and exit")
  args = p.parse_args(argv)
  if args.list:
    for i, name in enumerate(VARIANTS):
      print(f"{i:2d}  {name}")
    return 0
  jax.jit(lambda x: x + 1).lower(1.0).compile()
  names = list(VARIANTS)
  picked = names if args.variants == "all" else [names[int(i)] for i in args.variants.split(",")]
  if names[0] not in picked:
    picked.insert(0, names[0])

  adam = compile_time.build(args.workload, "adam", args.quick)
  built = {}
  for name in picked:
    config = VARIANTS[name][1]
    key = tuple(sorted((config or {}).items()))
    if key not in built:
      built[key] = compile_time.build(args.workload, args.front, args.quick, config=config)

  if args.regions:
    for label, (fn, fargs) in (("Adam", adam), (args.front, built[()])):
      counts = kernels(jax.jit(fn, donate_argnums=(0, 1)).lower(*fargs).compile().as_text())
      total = sum(counts.values())
      print(f"{args.workload} / {label}: {total:,} kernels")
      if label == "Adam":
        continue
      print("| region | kernels | share |\n|---|---:|---:|")
      for r, n in counts.most_common(args.regions):
        print(f"| {r} | {n:,} | {n / total:.1%} |")
    print()

  best: dict[str, list[float]] = {}
  for _ in range(args.repeats):
    for name in ["Adam"] + picked:
      if name == "Adam":
        fn, fargs, ctx = *adam, contextlib.nullcontext()
      else:
        make, extra = VARIANTS[name]
        fn, fargs = built[tuple(sorted((extra or {}).items()))]
        ctx = make()
      try:
        with ctx:
          got = measure(fn, fargs)
      except AttributeError as e:  # The library no longer has what the variant patches.
        print(f"  {name}: skipped ({e})", file=sys.stderr, flush=True)
        picked.remove(name)
        continue
      old = best.get(name)
      best[name] = [min(a, b) for a, b in zip(got, old)] if old else list(got)
      print(
        f"  {name}: trace+lower {got[0]:.2f} s, compile {got[1]:.2f} s ({got[2]:.2f} CPU s)",
        file=sys.stderr,
        flush=True,
      )

  base, adam_c = best[names[0]][2], best["Adam"][2]
  print(
    f"{args.workload} / {args.front}: minimum of {args.repeats} rounds; the change and the "
    "ratio to Adam in CPU seconds (steadier than wall time on a shared machine)"
  )
  print(
    "| variant | trace + lower, s | compile, s | compile, CPU s | change | / Adam | "
    "kernels |\n|---|---:|---:|---:|---:|---:|---:|"
  )
  for name in ["Adam"] + picked:
    tl, c, cpu, kern = best[name]
    print(
      f"| {name} | {tl:.2f} | {c:.2f} | {cpu:.2f} | {(cpu - base) / base:+.0%} | "
      f"{cpu / adam_c:.1f}x | {int(kern):,} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
