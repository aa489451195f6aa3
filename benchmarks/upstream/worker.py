"""Worker: trains a benchmark model with DeepMind's kfac-jax 0.0.8 and reports JSON.

Runs INSIDE the upstream virtualenv (`benchmarks/upstream/setup_venv.sh`), where `import kfac_jax`
is the upstream package (this repository's `kfac_jax` is never on `sys.path` here: the script
only imports jax, numpy, optax, the upstream package and `plain_models.py` next to it). The
benchmarks' `--with-upstream` writes the inputs and starts it as a subprocess:

    .venv-upstream/bin/python benchmarks/upstream/worker.py IN.npz CONFIG.json OUT_DIR

* `IN.npz`: the initial parameters (keys `param:<path>` with `/`-joined Flax paths, e.g.
  `param:params/dense_0/kernel`), the example pool and `batches` (int [steps, batch] indices
  into the pool, the same sequence the other contestants see). The pool is either `images`
  (float32 [M, 784]: the batch is `images[idx]`, the autoencoder) or arrays `data:x`, `data:y`
  (the batch is `{"x": x[idx], "y": y[idx]}`).
* `CONFIG.json`: `model` ("autoencoder", default, with `activations`: "tanh"/"linear" per layer
  `dense_0 ... dense_{L-1}`; "cnn" with `num_convs`; "transformer" with `num_layers`, `heads`; see
  `plain_models.py`), `learning_rate`, `momentum`, `damping`, `ema_decay`, `inverse_every`,
  `curvature_every` (optional, default 1: its `curvature_update_period`),
  `seed`, `compile_repeats`, `budget_s` (optional, the race: no step starts once the steps'
  seconds, the first one counted as a later same-phase one, reach it).
* `OUT_DIR` receives `result.json` and `final_params.npz` (same keys as the input), so the
  parent evaluates the final loss with exactly the code it uses for the other contestants.

With `adaptive` true in the config, upstream's optimizer is configured as its own examples
configure it: learning rate and momentum from the quadratic model, damping adapted from
`damping` (the initial value) every 5 steps (its default period). Otherwise it is configured
with everything adaptive switched off: constant
learning-rate, momentum and damping schedules, `l2_reg=0`, no burn-in, curvature statistics every
step from one sampled-target backward pass (`estimation_mode="fisher_gradients"`), EMA decay and
inverse period as given, pi-adjusted factored damping (its default), `multi_device=False`. The
loss is the one the parent uses: for the autoencoder, sigmoid cross-entropy summed over pixels,
mean over the batch, registered with `kfac_jax.register_sigmoid_cross_entropy_loss`; for the CNN,
softmax cross-entropy averaged over the batch; for the Transformer, softmax cross-entropy summed
over positions and averaged over the batch (both registered with
`register_softmax_cross_entropy_loss`, whose convention is a sum over every axis but the first,
the batch axis, averaged over that). `opt_state_bytes` is the sum of `nbytes` over the leaves of
upstream's state after `init`; `peak_bytes` is the device's `peak_bytes_in_use` after training
(None on CPU, which does not report it).

Compile time: `Optimizer.step` has no public lower/compile; it jit-compiles on its first call.
We report `first step wall time - median wall time of the later inverse-update steps` (step 0
also refreshes the inverses, so a typical *inverse* step is the right baseline); with
`compile_repeats > 1` the first step is re-run that many times in total on fresh optimizers after
`jax.clear_caches()` and the minimum is taken. `init_s` (the optimizer's `init`: graph matching
and its own jit-compiled state initialisation) is reported separately.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import plain_models  # benchmarks/upstream/plain_models.py (the script's directory is on sys.path).

import kfac_jax  # The upstream package (DeepMind kfac-jax 0.0.8) in this venv.

# This project's package has the same import name (it could come first on PYTHONPATH); it has
# `scale_by_kfac` and no `Optimizer`.
if not hasattr(kfac_jax, "Optimizer") or hasattr(kfac_jax, "scale_by_kfac"):
  raise ImportError(
    f"worker.py needs DeepMind's kfac-jax but imported {kfac_jax.__file__} (version "
    f"{getattr(kfac_jax, '__version__', '?')}), which is not it; run the worker with the "
    "upstream venv's python (bash benchmarks/upstream/setup_venv.sh prints its path)."
  )


def _load_params(npz) -> dict:
  """Nested dict from `param:a/b/c` keys (the Flax parameter tree, as plain dicts)."""
  tree: dict = {}
  for key in npz.files:
    if not key.startswith("param:"):
      continue
    *parents, leaf = key[len("param:") :].split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = jnp.asarray(npz[key])
  return tree


def _flatten(tree, prefix="") -> dict:
  out = {}
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else k
    if isinstance(v, dict):
      out.update(_flatten(v, path))
    else:
      out[f"param:{path}"] = np.asarray(v)
  return out


def make_loss_fn(cfg):
  """The parent's model in plain jax (`plain_models.py`) with upstream's loss tag."""
  model = cfg.get("model", "autoencoder")

  def loss_fn(params, batch):
    if model == "autoencoder":
      logits = plain_models.apply(cfg, params, batch)
      kfac_jax.register_sigmoid_cross_entropy_loss(logits, batch)
      return optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()
    logits = plain_models.apply(cfg, params, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return ce.mean() if model == "cnn" else ce.sum(-1).mean()

  return loss_fn


def _batch(pool, idx):
  if isinstance(pool, dict):
    return {k: v[idx] for k, v in pool.items()}
  return pool[idx]


def _tree_bytes(tree) -> int:
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    total += int(np.asarray(leaf).nbytes)
  return total


def _peak_bytes():
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # noqa: BLE001
    return None
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def layer_registrations(loss_fn, params, batch) -> list[dict]:
  """What upstream's graph matcher registers, via its public `auto_register_tags`: one
  `{"kind": variant, "params": [parameter paths]}` per layer tag, in graph order."""
  tagged = kfac_jax.auto_register_tags(loss_fn, (params, batch))
  jaxpr = jax.make_jaxpr(tagged)(params, batch).jaxpr
  leaves = jax.tree_util.tree_flatten_with_path((params, batch))[0]
  names = {
    v: "/".join(str(getattr(k, "key", k)) for k in path[1:])
    for v, (path, _) in zip(jaxpr.invars, leaves)
  }
  return [
    {"kind": str(e.params["meta"].variant), "params": [names[v] for v in e.invars if v in names]}
    for e in jaxpr.eqns
    if e.primitive.name == "layer_tag"
  ]


def make_optimizer(loss_fn, cfg):
  lr, mom, damping = cfg["learning_rate"], cfg["momentum"], cfg["damping"]
  if cfg.get("adaptive"):  # Its examples' setting: everything from the quadratic model.
    steps = dict(
      use_adaptive_learning_rate=True,
      use_adaptive_momentum=True,
      use_adaptive_damping=True,
      initial_damping=damping,
    )
  else:
    steps = dict(
      use_adaptive_learning_rate=False,
      learning_rate_schedule=lambda step: jnp.asarray(lr, jnp.float32),
      use_adaptive_momentum=False,
      momentum_schedule=lambda step: jnp.asarray(mom, jnp.float32),
      use_adaptive_damping=False,
      damping_schedule=lambda step: jnp.asarray(damping, jnp.float32),
    )
  return kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(loss_fn),
    l2_reg=0.0,
    **steps,
    num_burnin_steps=0,
    curvature_ema=cfg["ema_decay"],
    curvature_update_period=cfg.get("curvature_every", 1),
    inverse_update_period=cfg["inverse_every"],
    num_estimator_samples=1,
    multi_device=False,
    config=kfac_jax.Config(estimation_mode="fisher_gradients"),
  )


def run(inputs_path: str, config_path: str, out_dir: str) -> dict:
  with open(config_path) as f:
    cfg = json.load(f)
  data = np.load(inputs_path)
  if "images" in data.files:
    pool = np.asarray(data["images"], np.float32)
  else:
    pool = {k[len("data:") :]: np.asarray(data[k]) for k in data.files if k.startswith("data:")}
  batches = np.asarray(data["batches"])
  params0 = _load_params(data)
  if cfg.get("model") == "transformer":
    params0 = jax.tree_util.tree_map(jnp.asarray, plain_models.attention_to_2d(params0))
  loss_fn = make_loss_fn(cfg)
  example = jax.tree_util.tree_map(jnp.asarray, _batch(pool, batches[0]))

  registrations = layer_registrations(loss_fn, params0, example)
  print(f"upstream registrations: {json.dumps(registrations)}", flush=True)
  want = len(cfg.get("activations", ()))
  kinds = [r["kind"] for r in registrations]
  if cfg.get("model", "autoencoder") == "autoencoder" and kinds != ["dense"] * want:
    raise RuntimeError(
      f"upstream's graph matcher registered {kinds}, expected {want} "
      "dense layers; the comparison would not be K-FAC on every layer."
    )

  jax.jit(lambda x: x + 1).lower(1.0).compile()  # One-off JIT start-up, as in the parent.

  def first_step_and_state(seed_offset=0):
    """Fresh optimizer + init + one step; returns (init_s, first_step_s, params, state, rng,
    stats)."""
    jax.clear_caches()
    params = jax.tree.map(jnp.copy, params0)
    rng = jax.random.PRNGKey(cfg["seed"] + 1 + seed_offset)
    t0 = time.perf_counter()
    opt = make_optimizer(loss_fn, cfg)
    rng, init_rng = jax.random.split(rng)
    state = jax.block_until_ready(opt.init(params, init_rng, example))
    init_s = time.perf_counter() - t0
    batch = jax.device_put(example)
    state_bytes = _tree_bytes(state)
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    t0 = time.perf_counter()
    params, state, stats = opt.step(params, state, sub, batch=batch, global_step_int=0)
    jax.block_until_ready((params, state, stats))
    return opt, init_s, time.perf_counter() - t0, params, state, rng, stats, state_bytes

  opt, init_s, first_s, params, state, rng, stats, state_bytes = first_step_and_state()
  period = cfg["inverse_every"]
  losses = [float(stats["loss"])]
  times = [first_s]
  budget_s = cfg.get("budget_s")  # The race: stop once the charged seconds reach it.
  for t in range(1, len(batches)):
    # Step 0 (it compiles) is charged as the latest same-phase step, as the parent does.
    if (
      budget_s is not None
      and len(times) > 1
      and (sum(times[1:]) + times[max(1, (len(times) - 1) // period * period)] >= budget_s)
    ):
      break
    batch = jax.device_put(_batch(pool, batches[t]))
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    t0 = time.perf_counter()
    params, state, stats = opt.step(params, state, sub, batch=batch, global_step_int=t)
    jax.block_until_ready((params, state, stats))
    times.append(time.perf_counter() - t0)
    losses.append(float(stats["loss"]))
  if cfg.get("model") == "transformer":
    params = plain_models.attention_from_2d(params, cfg["heads"])
  np.savez(os.path.join(out_dir, "final_params.npz"), **_flatten(params))
  peak_bytes = _peak_bytes()

  first_times = [first_s]
  for r in range(1, max(1, int(cfg.get("compile_repeats", 1)))):
    first_times.append(first_step_and_state(seed_offset=r)[2])
  inverse_steps = [times[t] for t in range(1, len(times)) if t % period == 0]
  plain_steps = [times[t] for t in range(1, len(times)) if t % period != 0]
  baseline = inverse_steps or plain_steps
  baseline_s = float(np.median(baseline)) if baseline else 0.0
  return {
    "optimizer": f"kfac-jax {getattr(kfac_jax, '__version__', '?')} (upstream)",
    "upstream_version": getattr(kfac_jax, "__version__", None),
    "jax": jax.__version__,
    "python": platform.python_version(),
    "backend": jax.default_backend(),
    "registrations": registrations,
    "init_s": init_s,
    "first_step_s": first_times,
    "compile_baseline": "median inverse-update step"
    if inverse_steps
    else ("median step" if plain_steps else "none (a single step)"),
    "compile_baseline_s": baseline_s,
    "compile_s": max(0.0, min(first_times) - baseline_s),
    "opt_state_bytes": state_bytes,
    "peak_bytes": peak_bytes,
    "step_times_s": times,
    "losses": losses,
  }


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 3:
    print(__doc__.split("\n\n")[2], file=sys.stderr)
    return 2
  inputs_path, config_path, out_dir = argv
  result = run(inputs_path, config_path, out_dir)
  with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
