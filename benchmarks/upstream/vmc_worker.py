"""Worker: trains examples/vmc.py's wave function with DeepMind's kfac-jax 0.0.8, as FermiNet does.

Runs INSIDE the upstream virtualenv (`benchmarks/upstream/setup_venv.sh`); `benchmarks/vmc.py
--with-upstream` starts it as a subprocess:

    .venv-upstream/bin/python benchmarks/upstream/vmc_worker.py CONFIG.json OUT_DIR

The upstream package is imported first, so the example's own `import kfac_jax` gets it from
`sys.modules` (the worker checks this); the wave function, the initial parameters and burnt-in
walkers, the Metropolis sampler, the local energy and the custom_jvp loss with its normal tag on
log|ψ| are then the example's code, run by `examples.vmc.train` in its own loop (the Metropolis
keys after the start differ: `train` splits one key off for the optimizer's `init`). Only the
optimizer differs: upstream's `Optimizer` with FermiNet's settings (`ferminet/train.py` and
`base_config.py`): exact Fisher of the tag (`estimation_mode="fisher_exact"`), curvature EMA
0.95, statistics and inverses every step, `norm_constraint` 1e-3, `l2_reg` 0, no burn-in,
`min_damping` 1e-4, the learning-rate schedule `rate / (1 + t / delay)`, and momentum 0 and a
fixed damping passed to every `step`. `batch_size_extractor` reads the walkers' axis (upstream's
default reads the first leaf, here the nuclei).

* `CONFIG.json`: `system` ("He", "Li", "LiH"), `width` (one-electron stream), `steps`,
  `walkers`, `seed`, and optionally `layers` (2), `determinants` (2), `learning_rate` (0.05),
  `decay` (1000), `damping` (1e-3), `norm_constraint` (1e-3), `log_every` (0).
* `OUT_DIR` receives `result.json`: `energies` and `times` / `update_times` per step (seconds;
  the first steps include compilation), `registrations` (upstream's layer blocks) and versions.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp

import kfac_jax  # The upstream package (DeepMind kfac-jax 0.0.8) in this venv.

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "vmc.py")

# This project's package has the same import name; it has `scale_by_kfac`, upstream does not.
if not hasattr(kfac_jax, "Optimizer") or hasattr(kfac_jax, "scale_by_kfac"):
  raise ImportError(
    f"vmc_worker.py needs DeepMind's kfac-jax but imported {kfac_jax.__file__}; run it with the "
    "upstream venv's python (bash benchmarks/upstream/setup_venv.sh prints its path)."
  )


def load_example():
  """examples/vmc.py as a module whose `kfac_jax` is the upstream package."""
  spec = importlib.util.spec_from_file_location("vmc_example", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  if module.kfac_jax is not kfac_jax:
    raise ImportError(f"examples/vmc.py imported {module.kfac_jax.__file__}, not upstream's.")
  return module


def ferminet_optimizer(norm_constraint: float, registrations: list):
  """`make(loss_fn, params, batch, schedule, damping, key) -> (step, state)` for
  `examples.vmc.train`: upstream's Optimizer configured as FermiNet configures it. The layer
  blocks upstream's estimator built are appended to `registrations`."""

  def make(loss_fn, params, batch, schedule, damping, key):
    opt = kfac_jax.Optimizer(
      value_and_grad_func=jax.value_and_grad(loss_fn),
      l2_reg=0.0,
      norm_constraint=norm_constraint,
      learning_rate_schedule=schedule,
      curvature_ema=0.95,
      inverse_update_period=1,
      min_damping=1e-4,
      num_burnin_steps=0,
      estimation_mode="fisher_exact",
      multi_device=False,
      batch_size_extractor=lambda b: b["r"].shape[0],
    )
    state = opt.init(params, key, batch)
    registrations.extend(block_names(opt))
    momentum, damping = jnp.zeros([]), jnp.asarray(damping)
    counter = itertools.count()

    def step(params, state, batch, key):
      params, state, stats = opt.step(
        params,
        state,
        key,
        batch=batch,
        momentum=momentum,
        damping=damping,
        global_step_int=next(counter),
      )
      return params, state, stats["loss"]

    return step, state

  return make


def block_names(opt) -> list[str]:
  """Each curvature block upstream built, as `Class(shapes)` (e.g. `RepeatedDenseBlock`, or a
  diagonal block for a parameter no graph pattern matched). Upstream has no public accessor for
  its estimator; `_estimator` is read for this report only."""
  return [
    f"{type(b).__name__}({', '.join('x'.join(map(str, s)) for s in b.parameters_shapes)})"
    for b in opt._estimator.blocks  # noqa: SLF001
  ]


def run(cfg: dict) -> dict:
  vmc = load_example()
  registrations: list[str] = []
  out = vmc.train(
    vmc.SYSTEMS[cfg["system"]],
    vmc.Net(one=cfg["width"], layers=cfg.get("layers", 2), determinants=cfg.get("determinants", 2)),
    ferminet_optimizer(cfg.get("norm_constraint", 1e-3), registrations),
    steps=cfg["steps"],
    walkers=cfg["walkers"],
    learning_rate=cfg.get("learning_rate", 0.05),
    decay=cfg.get("decay", 1000.0),
    damping=cfg.get("damping", 1e-3),
    seed=cfg["seed"],
    log_every=cfg.get("log_every", 0),
  )
  return {
    "optimizer": f"kfac-jax {kfac_jax.__version__}",
    "jax": jax.__version__,
    "registrations": registrations,
    "energies": out["energies"].tolist(),
    "times": out["times"].tolist(),
    "update_times": out["update_times"].tolist(),
  }


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    print("\n\n".join(__doc__.split("\n\n")[1:3]), file=sys.stderr)
    return 2
  with open(argv[0]) as f:
    cfg = json.load(f)
  result = run(cfg)
  with open(os.path.join(argv[1], "result.json"), "w") as f:
    json.dump(result, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
