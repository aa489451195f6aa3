"""The full `Optimizer` step against upstream kfac-jax 0.0.8's and Adam's (issue 14, item 3).

The deep autoencoder (784-1000-500-250-30-250-500-1000-784), batch 1000, the settings of the
issue: learning rate and momentum from the quadratic model, adaptive damping from λ = 150, ρ
every 5 steps, inverses every 5 steps, EMA 0.95, one sampled target per example. Every
contestant runs in its own process, one after the other, for `--rounds` rounds (interleaved,
because the machine is shared); each process times `--steps` steps after `--warmup` and reports:

* `cycle_ms`: the median over whole 5-step cycles of the mean step (what training pays per step),
* `plain_ms` / `inverse_ms`: median of the steps without / with the inverse (and ρ) update,
* `compile_s`: ours and Adam's `jax.jit(step).lower(...).compile()`; upstream's first-step wall
  time minus its median inverse step (it has no public lower/compile, as in
  `benchmarks/upstream/worker.py`).

The driver prints, per contestant, the medians over rounds and the ratios `ours / upstream` and
`ours / adam` of each round's numbers (median over rounds).

    python benchmarks/profile/optimizer_step.py --rounds 3              # ours, upstream, adam
    python benchmarks/profile/optimizer_step.py --base /tmp/old_checkout  # + an older checkout
    python benchmarks/profile/optimizer_step.py --analyze               # jaxpr / HLO counts

`--analyze` prints, for our step (`CHECKOUT=<dir>` for another checkout), the matmul FLOPs of
its jaxpr in units of one forward pass, by enclosing cond, and, from the optimised HLO of the
donating compiled step, the copies, selects and conditionals with results of at least 1 MB
(factor- and inverse-sized); `HLO_OUT=<file>` saves that HLO. Every worker also reports CPU
time (`cpu_*`: `time.process_time`, all threads), less sensitive than wall time to other
processes on a shared machine.
The upstream contestant needs `.venv-upstream` (`bash benchmarks/upstream/setup_venv.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BATCH = 1000
DAMPING = 150.0
EVERY = 5
ACTIVATIONS = ["tanh"] * 3 + ["linear"] + ["tanh"] * 3 + ["linear"]


def _times_summary(times, cpu=None):
  out = _summary(times)
  if cpu is not None:
    out.update({"cpu_" + k: v for k, v in _summary(cpu).items()})
  return out


def _summary(times):
  times = np.asarray(times)
  cycles = times[: len(times) // EVERY * EVERY].reshape(-1, EVERY).mean(1)
  # Step t (0-based, after warm-up steps that are multiples of EVERY) is an inverse step when
  # t % EVERY == 0.
  inv = times[0::EVERY]
  plain = np.concatenate([times[k::EVERY] for k in range(1, EVERY)])
  inverse_ms = float(np.median(inv) * 1e3)
  return {
    "cycle_ms": float(np.median(cycles) * 1e3),
    "plain_ms": float(np.median(plain) * 1e3),
    "inverse_ms": inverse_ms,
  }


def _data(path):
  d = np.load(path)
  params = {"params": {}}
  for k in d.files:
    if k.startswith("param:"):
      _, layer, leaf = k[len("param:") :].split("/")
      params["params"].setdefault(layer, {})[leaf] = d[k]
  return params, d["images"]


# --------------------------------------------------------------------------------------------
# Workers (each in its own process).


def _our_setup(path):
  """The checkout's autoencoder: `(params, loss_fn, batches)` as device arrays (the workers for
  our code and Adam; the checkout is `CHECKOUT`, default this repository)."""
  sys.path.insert(0, os.environ.get("CHECKOUT", ROOT))
  import jax
  import jax.numpy as jnp

  from examples import autoencoder as ae

  params, images = _data(path)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  loss_fn = ae.make_loss_fn(ae.make_model())
  batches = [jnp.asarray(images[i * BATCH : (i + 1) * BATCH]) for i in range(4)]
  return params, loss_fn, batches


def worker_ours(path, steps, warmup):
  params, loss_fn, batches = _our_setup(path)
  import jax

  import kfac_jax

  opt = kfac_jax.Optimizer(
    loss_fn,
    batches[0],
    learning_rate=None,
    momentum=None,
    damping=DAMPING,
    use_adaptive_damping=True,
    inverse_every=EVERY,
    ema_decay=0.95,
    config=kfac_jax.Config(min_damping=1e-4),
  )
  state = opt.init(params)
  rng = jax.random.key(0)
  jax.jit(lambda x: x + 1).lower(1.0).compile()
  t0 = time.perf_counter()
  step = jax.jit(opt.step, donate_argnums=(0, 1)).lower(params, state, batches[0], rng).compile()
  compile_s = time.perf_counter() - t0
  times, cpu = [], []
  for t in range(warmup + steps):
    rng, k = jax.random.split(rng)
    b = batches[t % len(batches)]
    jax.block_until_ready((b, k))
    t0, c0 = time.perf_counter(), time.process_time()
    params, state, info = step(params, state, b, k)
    jax.block_until_ready((params, state, info))
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  out = _times_summary(times[warmup:], cpu[warmup:])
  out.update(compile_s=compile_s, loss=float(info["loss"]), file=kfac_jax.__file__)
  return out


def worker_adam(path, steps, warmup):
  params, loss_fn, batches = _our_setup(path)
  import jax
  import optax

  from examples import autoencoder as ae

  tx = optax.adam(1e-3)
  state = tx.init(params)
  rng = jax.random.key(0)
  jax.jit(lambda x: x + 1).lower(1.0).compile()
  t0 = time.perf_counter()
  step = (
    jax.jit(ae.make_adam_step(loss_fn, tx), donate_argnums=(0, 1))
    .lower(params, state, batches[0], rng)
    .compile()
  )
  compile_s = time.perf_counter() - t0
  times, cpu = [], []
  for t in range(warmup + steps):
    b = batches[t % len(batches)]
    t0, c0 = time.perf_counter(), time.process_time()
    params, state, loss = step(params, state, b, rng)
    jax.block_until_ready((params, state, loss))
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  out = _times_summary(times[warmup:], cpu[warmup:])
  out.update(compile_s=compile_s, loss=float(loss))
  return out


def worker_upstream(path, steps, warmup):
  # Runs in the upstream venv from `/`: this repository's kfac_jax is never importable here.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks", "upstream"))
  import jax
  import jax.numpy as jnp
  import optax
  import plain_models

  import kfac_jax

  assert hasattr(kfac_jax, "Optimizer") and not hasattr(kfac_jax, "scale_by_kfac"), (
    kfac_jax.__file__
  )
  params, images = _data(path)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  cfg = {"model": "autoencoder", "activations": ACTIVATIONS}

  def loss_fn(p, batch):
    logits = plain_models.apply(cfg, p, batch)
    kfac_jax.register_sigmoid_cross_entropy_loss(logits, batch)
    return optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()

  batches = [jnp.asarray(images[i * BATCH : (i + 1) * BATCH]) for i in range(4)]
  opt = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    use_adaptive_learning_rate=True,
    use_adaptive_momentum=True,
    use_adaptive_damping=True,
    initial_damping=DAMPING,
    min_damping=1e-4,
    damping_adaptation_interval=EVERY,
    num_burnin_steps=0,
    curvature_ema=0.95,
    inverse_update_period=EVERY,
    num_estimator_samples=1,
    multi_device=False,
    config=kfac_jax.Config(estimation_mode="fisher_gradients"),
  )
  rng = jax.random.PRNGKey(0)
  rng, k = jax.random.split(rng)
  state = opt.init(params, k, batches[0])
  jax.jit(lambda x: x + 1).lower(1.0).compile()
  times, cpu = [], []
  for t in range(warmup + steps):
    rng, k = jax.random.split(rng)
    b = batches[t % len(batches)]
    jax.block_until_ready((b, k))
    t0, c0 = time.perf_counter(), time.process_time()
    params, state, stats = opt.step(params, state, k, batch=b, global_step_int=t)
    jax.block_until_ready((params, state, stats))
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  out = _times_summary(times[warmup:], cpu[warmup:])
  out["compile_s"] = times[0] - out["inverse_ms"] / 1e3
  out.update(loss=float(stats["loss"]), file=kfac_jax.__file__, version=kfac_jax.__version__)
  return out


# --------------------------------------------------------------------------------------------
# Analysis of our compiled step.


def analyze():
  sys.path.insert(0, os.environ.get("CHECKOUT", ROOT))
  import jax

  import kfac_jax
  from examples import autoencoder as ae

  model = ae.make_model()
  params = ae.init_params(model)
  loss_fn = ae.make_loss_fn(model)
  x = jax.random.uniform(jax.random.key(0), (BATCH, 784))
  opt = kfac_jax.Optimizer(
    loss_fn,
    x,
    damping=DAMPING,
    inverse_every=EVERY,
    config=kfac_jax.Config(min_damping=1e-4),
  )
  state = opt.init(params)
  rng = jax.random.key(0)
  jaxpr = jax.make_jaxpr(opt.step)(params, state, x, rng)

  counts = {}

  def walk(jx, where):
    for e in jx.eqns:
      for v in e.params.values():
        for j in v if isinstance(v, (tuple, list)) else [v]:
          inner = getattr(j, "jaxpr", j)
          if hasattr(inner, "eqns"):
            walk(inner, where + "/" + e.primitive.name)
      if e.primitive.name == "dot_general":
        (lc, _), _ = e.params["dimension_numbers"]
        lhs = e.invars[0].aval.shape
        flops = 2 * np.prod(e.outvars[0].aval.shape) * np.prod([lhs[d] for d in lc])
        counts[where] = counts.get(where, 0) + flops

  walk(jaxpr.jaxpr, "")
  widths = [784, 1000, 500, 250, 30, 250, 500, 1000, 784]
  forward = 2 * BATCH * sum(a * b for a, b in zip(widths[:-1], widths[1:]))
  print("matmul FLOPs in units of one forward pass, by enclosing primitive path:")
  for k, v in sorted(counts.items()):
    print(f"  {v / forward:6.2f}  {k or '(top level)'}")
  print(f"  total {sum(counts.values()) / forward:.2f}")

  compiled = jax.jit(opt.step, donate_argnums=(0, 1)).lower(params, state, x, rng).compile()
  hlo = compiled.as_text()
  big = 1 << 20
  sizes = {"f32": 4, "s32": 4, "f64": 8, "pred": 1, "bf16": 2}
  tally = {}
  comp = None
  for line in hlo.splitlines():
    h = re.match(r"^(ENTRY )?%?([\w.\-]+) ", line)
    if h and "{" in line and "=" not in line.split("{")[0]:
      comp = "ENTRY" if h.group(1) else h.group(2)
      continue
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\(?[^=]*?\)?) (copy|select|conditional)\(", line)
    if not m:
      continue
    total = 0
    for dt, dims in re.findall(r"(f32|s32|f64|pred|bf16)\[([\d,]*)\]", m.group(1)):
      n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      total += n * sizes[dt]
    if total >= big:
      where = "fused" if comp.startswith(("fused", "wrapped")) else comp
      key = (m.group(2), where if where in ("ENTRY", "fused") else "branch/region")
      c, b = tally.get(key, (0, 0))
      tally[key] = (c + 1, b + total)
  print("optimised HLO, copies / selects / conditionals with >= 1 MB results, per computation:")
  for (op, where), (c, b) in sorted(tally.items(), key=lambda kv: -kv[1][1]):
    print(f"  {op:12s} {c:4d}  {b / 1e6:8.1f} MB  in {where}")
  if os.environ.get("HLO_OUT"):
    with open(os.environ["HLO_OUT"], "w") as f:
      f.write(hlo)


# --------------------------------------------------------------------------------------------
# Driver.


def _run(kind, python, path, args, checkout=None):
  env = dict(os.environ)
  env.pop("PYTHONPATH", None)
  if checkout:
    env["CHECKOUT"] = checkout
  cmd = [python, os.path.abspath(__file__), "--worker", kind, "--data", path]
  cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
  res = subprocess.run(
    cmd, cwd="/" if kind == "upstream" else ROOT, env=env, capture_output=True, text=True
  )
  if res.returncode:
    raise RuntimeError(f"{kind} failed:\n{res.stderr[-3000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=40, help="timed steps (a multiple of 5)")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps (a multiple of 5)")
  p.add_argument("--base", default=None, help="an older checkout to time as well ('base')")
  p.add_argument("--no-upstream", action="store_true")
  p.add_argument("--no-adam", action="store_true")
  p.add_argument("--upstream-python", default=os.path.join(ROOT, ".venv-upstream/bin/python"))
  p.add_argument("--analyze", action="store_true")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--data", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    fn = {"ours": worker_ours, "adam": worker_adam, "upstream": worker_upstream}[args.worker]
    print(json.dumps(fn(args.data, args.steps, args.warmup)))
    return 0
  if args.analyze:
    analyze()
    return 0

  sys.path.insert(0, ROOT)
  import jax

  from examples import autoencoder as ae

  params = ae.init_params(ae.make_model())
  images = np.asarray(jax.random.uniform(jax.random.key(1), (4 * BATCH, 784)), np.float32)
  flat = {
    f"param:params/{layer}/{leaf}": np.asarray(v)
    for layer, d in params["params"].items()
    for leaf, v in d.items()
  }
  path = os.path.join(tempfile.mkdtemp(), "data.npz")
  np.savez(path, images=images, **flat)
  contestants = [("ours", sys.executable, None)]
  if args.base:
    contestants.append(("base", sys.executable, os.path.abspath(args.base)))
  if not args.no_upstream:
    contestants.append(("upstream", args.upstream_python, None))
  if not args.no_adam:
    contestants.append(("adam", sys.executable, None))
  results = {name: [] for name, _, _ in contestants}
  for r in range(args.rounds):
    for name, python, checkout in contestants:
      kind = "ours" if name == "base" else name
      out = _run(kind, python, path, args, checkout or ROOT)
      results[name].append(out)
      print(
        f"round {r} {name:9s} "
        + " ".join(f"{k} {v:.4g}" for k, v in out.items() if isinstance(v, float)),
        flush=True,
      )
  keys = ("cycle_ms", "plain_ms", "inverse_ms", "cpu_cycle_ms", "compile_s")
  print("\nmedian over rounds:")
  for name in results:
    print(
      f"  {name:9s} "
      + "  ".join(f"{k} {np.median([o[k] for o in results[name]]):8.2f}" for k in keys)
    )
  for other in ("base", "upstream", "adam"):
    if other not in results:
      continue
    ratios = {
      k: np.median([a[k] / b[k] for a, b in zip(results["ours"], results[other])]) for k in keys
    }
    print(f"  ours / {other:9s}" + "  ".join(f"{k} {v:6.3f}" for k, v in ratios.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
