"""Where one compiled training step's time goes, thunk by thunk, from a JAX profiler trace.

Compiles one race workload's step (`kfac` with the given settings, or Adam), runs it until the
next update is of the asked phase (plain, statistics, inverses), and traces that update with
`jax.profiler` (a Perfetto trace). Each XLA:CPU thunk in the trace is matched to its op_name in
the compiled program and its busy time (start to end, asynchronous thunks included) is summed
by part:
- the model's forward and backward pass (`jvp(` / `transpose(` in the op name),
- K-FAC's statistics, inverses and products (the estimator's `kfac_statistics`,
  `kfac_inverses` and `kfac_multiply_*` named scopes),
- the rest (momentum, clipping, the update, copies).
Two sums per part: the wall time during which at least one of its thunks ran, and the thread
time (the thunks' busy times added up). XLA:CPU runs independent thunks on both cores at once,
and a thunk waiting for a busy thread pool still counts as busy, so thread times add up to more
than the step's wall time (printed below them); the wall column is the one to compare with it. `--top` lists the longest
thunks with their shapes. Needs a quiet machine (it measures time).

    python benchmarks/profile/step_timeline.py --workload autoencoder --lr 1 --damping 0.03 \\
      --preconditioner-dtype bfloat16
    python benchmarks/profile/step_timeline.py --workload autoencoder --adam
    python benchmarks/profile/step_timeline.py --workload autoencoder --quick   # smoke test
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks import _harness, race  # noqa: E402
from benchmarks.profile.phase_times import update_kind  # noqa: E402

PARTS = (
  ("K-FAC statistics", ("kfac_statistics",)),
  ("K-FAC inverses", ("kfac_inverses",)),
  ("K-FAC products", ("kfac_multiply",)),
  ("forward and backward", ("jvp(", "transpose(")),
)
OTHER = "other"

_DEF = re.compile(r"^\s*%?([\w.\-]+) = (\S+) ([^\n]*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def thunk_info(hlo_text: str) -> dict[str, tuple[str, str]]:
  """Instruction name → (result shape, op_name) from a compiled program's HLO text."""
  out = {}
  for m in _DEF.finditer(hlo_text):
    op = _OP_NAME.search(m.group(3))
    out.setdefault(m.group(1), (m.group(2), op.group(1) if op else ""))
  return out


def part_of(op_name: str) -> str:
  for part, keys in PARTS:
    if any(k in op_name for k in keys):
      return part
  return OTHER


def busy_intervals(events, names) -> list[tuple[str, float, float]]:
  """(thunk, start µs, end µs) of every execution of a thunk in `names`. An asynchronous thunk
  (Eigen's dots) ends at its "end: NAME" marker, after its own event has closed."""
  ends = collections.defaultdict(list)
  for e in events:
    n = e.get("name", "")
    if n.startswith("end: "):
      ends[n[5:]].append(e["ts"])
  out = []
  for e in events:
    n = e.get("name")
    # Control-flow thunks contain their branches' thunks, which the trace times themselves.
    if e.get("ph") != "X" or n not in names or n.startswith(("cond", "while", "call")):
      continue
    start, stop = e["ts"], e["ts"] + e.get("dur", 0)
    later = [t for t in ends.get(n, ()) if t >= start]
    out.append((n, start, max(stop, min(later)) if later else stop))
  return out


def union_ms(intervals) -> float:
  """Milliseconds covered by at least one of the (start µs, end µs) intervals."""
  total, reach = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop > reach:
      total += stop - max(start, reach)
      reach = stop
  return total / 1e3


def _trace_events(directory: str) -> list[dict]:
  files = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
  if not files:
    raise RuntimeError(f"no perfetto_trace.json.gz under {directory} (jax.profiler changed?)")
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", default="autoencoder", choices=sorted(race.WORKLOADS))
  p.add_argument("--adam", action="store_true", help="trace Adam's step instead of kfac's")
  p.add_argument("--adam-lr", type=float, default=1e-3)
  p.add_argument("--lr", type=float, default=1.0, help="kfac's learning rate")
  p.add_argument("--momentum", type=float, default=0.7)
  p.add_argument("--damping", type=float, default=0.1)
  p.add_argument("--curvature-every", type=int, default=5)
  p.add_argument("--inverse-every", type=int, default=10)
  p.add_argument("--preconditioner-dtype", default=None, choices=("bfloat16", "float32"))
  p.add_argument(
    "--phase",
    default="plain",
    choices=("plain", "statistics", "inverses"),
    help="which kind of update to trace ('inverses': statistics and inverses)",
  )
  p.add_argument("--top", type=int, default=12, help="list this many of the longest thunks")
  args, rest = p.parse_known_args(argv)
  mod = race.WORKLOADS[args.workload]
  wl = mod.parse_args(list(rest) + ["--plot", ""])
  workload = race.cyclic(mod.make_workload(wl), wl.warmup + wl.steps)
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  c, i = args.curvature_every, args.inverse_every
  if args.adam:
    contestant = _harness.first_order("Adam", "adam", workload.loss_fn, optax.adam(args.adam_lr))
    target = 2
  else:
    contestant = _harness.kfac_transform(
      workload.loss_fn,
      example,
      learning_rate=args.lr,
      momentum=args.momentum,
      damping=args.damping,
      ema_decay=0.95,
      inverse_every=i,
      curvature_every=c,
      preconditioner_dtype=args.preconditioner_dtype,
    )
    want = {"plain": "plain", "statistics": "statistics", "inverses": "statistics + inverses"}
    if args.phase == "inverses" and (i % c):
      want["inverses"] = "inverses"
    span = range(max(c, i) + 1, 10 * max(c, i) + 2)
    target = next((n for n in span if update_kind(n, c, i) == want[args.phase]), None)
    if target is None:
      p.error(f"no {args.phase!r} update with statistics every {c} and inverses every {i}")

  params = jax.tree.map(lambda x: jnp.array(x, copy=True), workload.params0)  # Donated.
  state = contestant.init(params)
  rng = jax.random.key(0)
  batch0 = jax.tree.map(jax.device_put, workload.batch_at(0))
  step_fn = jax.jit(contestant.step, donate_argnums=(0, 1))
  compiled = step_fn.lower(params, state, batch0, rng).compile()
  info = thunk_info(compiled.as_text())

  with tempfile.TemporaryDirectory() as tmp:
    for t in range(target + 1):
      batch = jax.tree.map(jax.device_put, workload.batch_at(t))
      rng, sub = jax.random.split(rng)
      jax.block_until_ready((batch, sub))
      if t == target:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
      start = time.perf_counter()
      params, state, _ = jax.block_until_ready(compiled(params, state, batch, sub))
      wall = time.perf_counter() - start
      if t == target:
        jax.profiler.stop_trace()
    events = _trace_events(tmp)

  spans = busy_intervals(events, info)
  if not spans:
    raise RuntimeError("the trace has no thunk of the compiled step (jax.profiler changed?)")
  per_part = collections.Counter()
  per_thunk = collections.Counter()
  covered = collections.defaultdict(list)
  for name, start, stop in spans:
    part = part_of(info[name][1])
    per_part[part] += stop - start
    per_thunk[name] += stop - start
    covered[part].append((start, stop))
  first, last = min(s for _, s, _ in spans), max(e for _, _, e in spans)

  who = (
    "Adam"
    if args.adam
    else (
      f"kfac lr {args.lr:g}, momentum {args.momentum:g}, damping {args.damping:g}, statistics "
      f"every {c}, inverses every {i}, preconditioner_dtype "
      f"{args.preconditioner_dtype or 'float32'}; update {target} ({update_kind(target, c, i)})"
    )
  )
  print(f"{workload.name}: {workload.description}")
  print(f"{who}; jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs)\n")
  print("| part | wall time with one of its thunks running (ms) | thread time (ms) | share |")
  print("|---|---:|---:|---:|")
  total = sum(per_part.values())
  for part in [name for name, _ in PARTS] + [OTHER]:
    print(
      f"| {part} | {union_ms(covered[part]):.1f} | {per_part[part] / 1e3:.1f} | "
      f"{per_part[part] / total:.0%} |"
    )
  every = [(s, e) for _, s, e in spans]
  print(f"| all thunks | {union_ms(every):.1f} | {total / 1e3:.1f} | |")
  print(
    f"\nstep wall time {1e3 * wall:.1f} ms (traced); first thunk to last: "
    f"{(last - first) / 1e3:.1f} ms\n"
  )
  print("| thunk | ms | shape | part | op_name |")
  print("|---|---:|---|---|---|")
  for name, us in per_thunk.most_common(args.top):
    shape, op = info[name]
    print(f"| {name} | {us / 1e3:.2f} | `{shape}` | {part_of(op)} | `{op[-70:]}` |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
