"""Worker: trains the benchmark autoencoder with DeepMind's kfac-jax 0.0.8 and reports JSON.

Runs INSIDE the upstream virtualenv (`benchmarks/upstream/setup_venv.sh`), where `import kfac_jax`
is the upstream package (this repository's `kfac_jax` is never on `sys.path` here: the script
only imports jax, numpy, optax and the upstream package). `benchmarks/autoencoder.py
--with-upstream` writes the inputs and starts it as a subprocess:

    .venv-upstream/bin/python benchmarks/upstream/worker.py IN.npz CONFIG.json OUT_DIR

* `IN.npz`: the initial parameters (keys `param:<path>` with `/`-joined Flax paths, e.g.
  `param:params/dense_0/kernel`), `images` (float32 [M, 784], only the images the run uses) and
  `batches` (int [steps, batch] indices into `images`, the same sequence the other contestants
  see).
* `CONFIG.json`: `activations` (one of "tanh"/"linear" per layer `dense_0 ... dense_{L-1}`),
  `learning_rate`, `momentum`, `damping`, `ema_decay`, `inverse_every`, `seed`,
  `compile_repeats`.
* `OUT_DIR` receives `result.json` and `final_params.npz` (same keys as the input), so the
  parent evaluates the final loss with exactly the code it uses for the other contestants.

Upstream's optimizer is configured with everything adaptive switched off: constant
learning-rate, momentum and damping schedules, `l2_reg=0`, no burn-in, curvature statistics every
step from one sampled-target backward pass (`estimation_mode="fisher_gradients"`), EMA decay and
inverse period as given, pi-adjusted factored damping (its default), `multi_device=False`. The
loss is the one the parent uses: sigmoid cross-entropy summed over pixels, mean over the batch,
registered with `kfac_jax.register_sigmoid_cross_entropy_loss`, whose documented convention is
exactly that normalisation.

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

import kfac_jax  # The upstream package (DeepMind kfac-jax 0.0.8) in this venv.

# This project's package has the same import name (it could come first on PYTHONPATH); it has
# `scale_by_kfac` and no `Optimizer`.
if not hasattr(kfac_jax, "Optimizer") or hasattr(kfac_jax, "scale_by_kfac"):
  raise ImportError(
      f"worker.py needs DeepMind's kfac-jax but imported {kfac_jax.__file__} (version "
      f"{getattr(kfac_jax, '__version__', '?')}), which is not it; run the worker with the upstream "
      "venv's python (bash benchmarks/upstream/setup_venv.sh prints its path).")


def _load_params(npz) -> dict:
  """Nested dict from `param:a/b/c` keys (the Flax parameter tree, as plain dicts)."""
  tree: dict = {}
  for key in npz.files:
    if not key.startswith("param:"):
      continue
    *parents, leaf = key[len("param:"):].split("/")
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


def make_loss_fn(activations):
  """The benchmark's autoencoder in plain jax: `x @ kernel + bias` per layer ([in, out] kernels,
  as in Flax), tanh or identity after each, and the registered sigmoid cross-entropy."""

  def loss_fn(params, batch):
    x = batch
    for i, act in enumerate(activations):
      layer = params["params"][f"dense_{i}"]
      x = x @ layer["kernel"] + layer["bias"]
      if act == "tanh":
        x = jnp.tanh(x)
    kfac_jax.register_sigmoid_cross_entropy_loss(x, batch)
    return optax.sigmoid_binary_cross_entropy(x, batch).sum(-1).mean()

  return loss_fn


def layer_registrations(loss_fn, params, batch) -> list[str]:
  """Layer kinds upstream's graph matcher assigns (one entry per layer tag), via its public
  `auto_register_tags`."""
  tagged = kfac_jax.auto_register_tags(loss_fn, (params, batch))
  jaxpr = jax.make_jaxpr(tagged)(params, batch)
  return [str(e.params["meta"].variant) for e in jaxpr.jaxpr.eqns
          if e.primitive.name == "layer_tag"]


def make_optimizer(loss_fn, cfg):
  lr, mom, damping = cfg["learning_rate"], cfg["momentum"], cfg["damping"]
  return kfac_jax.Optimizer(
      value_and_grad_func=jax.value_and_grad(loss_fn),
      l2_reg=0.0,
      use_adaptive_learning_rate=False,
      learning_rate_schedule=lambda step: jnp.asarray(lr, jnp.float32),
      use_adaptive_momentum=False,
      momentum_schedule=lambda step: jnp.asarray(mom, jnp.float32),
      use_adaptive_damping=False,
      damping_schedule=lambda step: jnp.asarray(damping, jnp.float32),
      num_burnin_steps=0,
      estimation_mode="fisher_gradients",
      curvature_ema=cfg["ema_decay"],
      curvature_update_period=1,
      inverse_update_period=cfg["inverse_every"],
      num_estimator_samples=1,
      multi_device=False,
  )


def run(inputs_path: str, config_path: str, out_dir: str) -> dict:
  with open(config_path) as f:
    cfg = json.load(f)
  data = np.load(inputs_path)
  images = np.asarray(data["images"], np.float32)
  batches = np.asarray(data["batches"])
  params0 = _load_params(data)
  loss_fn = make_loss_fn(cfg["activations"])
  example = jnp.asarray(images[batches[0]])

  registrations = layer_registrations(loss_fn, params0, example)
  want = len(cfg["activations"])
  if registrations != ["dense"] * want:
    raise RuntimeError(f"upstream's graph matcher registered {registrations}, expected {want} "
                       "dense layers; the comparison would not be K-FAC on every layer.")

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
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    t0 = time.perf_counter()
    params, state, stats = opt.step(params, state, sub, batch=batch, global_step_int=0)
    jax.block_until_ready((params, state, stats))
    return opt, init_s, time.perf_counter() - t0, params, state, rng, stats

  opt, init_s, first_s, params, state, rng, stats = first_step_and_state()
  losses = [float(stats["loss"])]
  times = [first_s]
  for t in range(1, len(batches)):
    batch = jax.device_put(images[batches[t]])
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    t0 = time.perf_counter()
    params, state, stats = opt.step(params, state, sub, batch=batch, global_step_int=t)
    jax.block_until_ready((params, state, stats))
    times.append(time.perf_counter() - t0)
    losses.append(float(stats["loss"]))
  np.savez(os.path.join(out_dir, "final_params.npz"), **_flatten(params))

  first_times = [first_s]
  for r in range(1, max(1, int(cfg.get("compile_repeats", 1)))):
    first_times.append(first_step_and_state(seed_offset=r)[2])
  period = cfg["inverse_every"]
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
      "compile_baseline": "median inverse-update step" if inverse_steps else
                          ("median step" if plain_steps else "none (a single step)"),
      "compile_baseline_s": baseline_s,
      "compile_s": max(0.0, min(first_times) - baseline_s),
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
