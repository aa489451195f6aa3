"""A physics-informed network for the 2-d Poisson equation, trained with K-FAC and with Adam.

    −Δu = 2π² sin(πx) sin(πy) on [0, 1]²,   u = 0 on the boundary,   solution sin(πx) sin(πy).

An MLP 2-64-1 with tanh (257 parameters, float64) is fitted on 900 interior and 120 boundary
points; the error is the relative L2 error on 9,000 points. The Laplacian is
`kfac_jax.pinn.laplacian` (the forward Laplacian: value, gradient and Laplacian channels through
each layer), so the scanner sees each layer applied to the points and to those channels and
registers it as one shared layer (the "expand" K-FAC of physics-informed networks). The two
loss terms are tagged separately, each a mean over its own points. K-FAC runs twice:
`kfac_jax.pinn.optimizer` (learning rate, momentum and damping from the quadratic model) and
`kfac_jax.pinn.kfac` (the chain with the paper's grid line search, `make_kfac`); the run writes
a plot of the error against steps and seconds.

    python examples/pinn_poisson.py              # 200 steps of each K-FAC, 2,000 of Adam
    python examples/pinn_poisson.py --steps 2000 --adam-steps 20000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NamedTuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  # Lets `python examples/pinn_poisson.py` work from a checkout without `pip install -e .`.
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from examples import plotting  # noqa: E402

DEFAULT_STEPS = 200
DEFAULT_ADAM_STEPS = 2000
DEFAULT_ADAM_LR = 1.7e-3
SIZES = (2, 64, 1)
# The paper's best K-FAC run on this problem (a random search of 50): moving average, momentum
# and damping, as logged.
PAPER_EMA = 0.4496490467123582
PAPER_MOMENTUM = 0.5117574706015794
PAPER_DAMPING = 1.5440986717145857e-12


class Problem(NamedTuple):
  batch: dict  # "interior" [900, 2], "boundary" [120, 2]
  x_eval: jax.Array  # [9000, 2]
  u_eval: jax.Array  # [9000], the exact solution there


def solution(x):
  return jnp.sin(jnp.pi * x[:, 0]) * jnp.sin(jnp.pi * x[:, 1])


def source(x):
  return 2 * jnp.pi**2 * solution(x)


def make_problem(seed=0, n_interior=900, n_boundary=120, dtype=jnp.float64) -> Problem:
  """Uniform interior points, boundary points spread evenly over the four edges."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  interior = jax.random.uniform(k1, (n_interior, 2), dtype)
  t = jax.random.uniform(k2, (n_boundary,), dtype)
  side = jnp.arange(n_boundary) % 4
  zero, one = jnp.zeros_like(t), jnp.ones_like(t)
  xs = jnp.select([side == 0, side == 1, side == 2], [t, one, t], zero)
  ys = jnp.select([side == 0, side == 1, side == 2], [zero, t, one], t)
  boundary = jnp.stack([xs, ys], axis=1)
  x_eval = jax.random.uniform(k3, (9000, 2), dtype)
  return Problem({"interior": interior, "boundary": boundary}, x_eval, solution(x_eval))


def init_params(seed: int = 0, sizes=SIZES, dtype=jnp.float64) -> list[dict]:
  """Kernels and biases uniform in ±1/√fan_in (PyTorch's `nn.Linear` default, as in the K-FAC
  for PINNs paper): nonzero biases spread the tanh units over the domain."""
  params, key = [], jax.random.key(seed + 100)
  for a, b in zip(sizes[:-1], sizes[1:]):
    key, kw, kb = jax.random.split(key, 3)
    bound = 1.0 / np.sqrt(a)
    w = jax.random.uniform(kw, (a, b), dtype, -bound, bound)
    params.append({"w": w, "b": jax.random.uniform(kb, (b,), dtype, -bound, bound)})
  return params


def mlp(params, x):
  """u at the points `x` [N, d] ([N]), or at one point [d] (a scalar)."""
  for i, p in enumerate(params):
    x = x @ p["w"] + p["b"]
    if i < len(params) - 1:
      x = jnp.tanh(x)
  return x[..., 0]


def loss_fn(params, batch):
  """½ mean(residual²) over the interior + ½ mean(u²) over the boundary (the paper's scaling),
  each term tagged as a normal of variance 1 (negative log-likelihood ½ r²), so that each
  term's output factor is its Gauss-Newton matrix `Jᵀ J / N`."""
  x = batch["interior"]
  residual = (kfac_jax.pinn.laplacian(lambda y: mlp(params, y), x) + source(x))[:, None]
  kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
  u = mlp(params, batch["boundary"])[:, None]
  kfac_jax.register_normal_predictive_distribution(u, var=1.0)
  return 0.5 * jnp.mean(residual**2) + 0.5 * jnp.mean(u**2)


def relative_l2(params, problem: Problem):
  u = mlp(params, problem.x_eval)
  return jnp.linalg.norm(u - problem.u_eval) / jnp.linalg.norm(problem.u_eval)


class Run(NamedTuple):
  name: str
  steps: np.ndarray  # the steps at which the error was measured
  seconds: np.ndarray  # cumulative step time there (compilation excluded)
  errors: np.ndarray  # relative L2 error there


def _record_at(steps: int, points: int = 60) -> set[int]:
  return set(np.unique(np.geomspace(1, steps, points).astype(int)).tolist()) | {0, steps}


def run(name: str, step, state, params, problem: Problem, steps: int, progress: bool) -> Run:
  """`steps` calls of the jitted `step(params, state) -> (params, state, loss)`, timed; the
  error measured (outside the timing) at about 60 steps spread geometrically."""
  from tqdm.auto import tqdm

  step = jax.jit(step)
  error = jax.jit(relative_l2)
  jax.block_until_ready(step(params, state))  # Compile outside the timing.
  record = _record_at(steps)
  out_steps, out_secs, out_errs = [0], [0.0], [float(error(params, problem))]
  elapsed = 0.0
  bar = tqdm(range(1, steps + 1), desc=name, disable=not progress, file=sys.stderr)
  for t in bar:
    start = time.perf_counter()
    params, state, loss = step(params, state)
    jax.block_until_ready(params)
    elapsed += time.perf_counter() - start
    if t in record:
      out_steps.append(t)
      out_secs.append(elapsed)
      out_errs.append(float(error(params, problem)))
      bar.set_postfix(loss=f"{float(loss):.2e}", l2=f"{out_errs[-1]:.2e}", refresh=False)
  bar.close()
  return Run(name, np.asarray(out_steps), np.asarray(out_secs), np.asarray(out_errs))


def make_kfac(params, batch, loss=None, linesearch: str = "grid"):
  """The `kfac_jax.kfac` chain with a line search. With `linesearch="grid"`,
  `kfac_jax.pinn.kfac`: the K-FAC of the PINN paper's code with its best 2-d Poisson settings
  to the digit (`PAPER_EMA`, `PAPER_MOMENTUM`, `PAPER_DAMPING`). With "zoom", optax's zoom line
  search, momentum 0.51, a fixed damping of 1e-10 and the same statistics (exact Gauss-Newton,
  refreshed at every step, moving average 0.45). Returns `(tx, registration)`; `tx.update`
  takes `value=`, `grad=`, `value_fn=`."""
  if linesearch not in ("grid", "zoom"):
    raise ValueError(f"make_kfac: linesearch must be 'grid' or 'zoom', got {linesearch!r}.")
  reg = kfac_jax.Registration(loss or loss_fn, params, batch, estimation_mode="exact_GGN")
  if linesearch == "grid":
    tx = kfac_jax.pinn.kfac(
      registration=reg, momentum=PAPER_MOMENTUM, ema_decay=PAPER_EMA, damping=PAPER_DAMPING
    )
    return tx, reg
  tx = kfac_jax.kfac(
    registration=reg,
    linesearch=optax.scale_by_zoom_linesearch(max_linesearch_steps=20),
    momentum=0.51,
    max_norm=None,
    damping=1e-10,
    ema_decay=0.45,
    inverse_every=1,
    curvature_every=1,
  )
  return tx, reg


def linesearch_step(tx, reg, batch, loss=None, rng=None):
  """`step(params, state) -> (params, state, loss)` for `make_kfac`'s transform: loss, gradient
  and statistics from one pass; the line search evaluates `loss(·, batch)` along the step."""
  loss = loss or loss_fn
  value_fn = lambda p: loss(p, batch)  # noqa: E731
  rng = jax.random.key(1) if rng is None else rng

  def step(params, state):
    value, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    updates, state = tx.update(
      grads, state, params, curvature_stats=stats, value=value, grad=grads, value_fn=value_fn
    )
    return optax.apply_updates(params, updates), state, value

  return step


def kfac_linesearch_run(problem: Problem, params, steps: int, progress: bool):
  """`make_kfac`'s K-FAC for `steps` steps."""
  tx, reg = make_kfac(params, problem.batch)
  step = linesearch_step(tx, reg, problem.batch)
  return run("kfac line search", step, tx.init(params), params, problem, steps, progress)


def kfac_run(problem: Problem, params, steps: int, progress: bool, damping: float = 0.5):
  """`kfac_jax.pinn.optimizer`'s K-FAC for `steps` steps."""
  opt = kfac_jax.pinn.optimizer(loss_fn, params, problem.batch, damping=damping)
  rng = jax.random.key(1)

  def step(params, state):
    params, state, info = opt.step(params, state, problem.batch, rng)
    return params, state, info["loss"]

  return run("K-FAC", step, opt.init(params), params, problem, steps, progress)


def adam_run(problem: Problem, params, steps: int, progress: bool, lr: float = DEFAULT_ADAM_LR):
  tx = optax.adam(lr)

  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, problem.batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return run("Adam", step, tx.init(params), params, problem, steps, progress)


def plot(runs: list[Run], path: str) -> None:
  plotting.steps_and_seconds(
    [(r.name, np.maximum(r.steps, 1), np.maximum(r.seconds, 1e-3), r.errors) for r in runs],
    path,
    title="2-d Poisson, MLP 2-64-1 tanh, 900 + 120 points",
    ylabel="relative L2 error",
    log_x=True,
  )


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--steps", type=int, default=None, help=f"K-FAC steps ({DEFAULT_STEPS})")
  p.add_argument("--adam-steps", type=int, default=None, help=f"Adam steps ({DEFAULT_ADAM_STEPS})")
  p.add_argument("--adam-lr", type=float, default=DEFAULT_ADAM_LR)
  p.add_argument("--damping", type=float, default=0.5, help="K-FAC initial damping")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="pinn_poisson.png", help="PNG path for the curves")
  p.add_argument("--fast", action="store_true", help="a few steps (for tests)")
  p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bars")
  args = p.parse_args(argv)
  if args.steps is None:
    args.steps = 5 if args.fast else DEFAULT_STEPS
  if args.adam_steps is None:
    args.adam_steps = 20 if args.fast else DEFAULT_ADAM_STEPS
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)  # The problem is solved in float64.
  try:
    problem = make_problem(args.seed)
    params = init_params(args.seed)
    n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    print(f"MLP {'-'.join(map(str, SIZES))} tanh, {n} parameters, float64", flush=True)
    print(kfac_jax.summary(loss_fn, params, problem.batch), flush=True)
    runs = [
      kfac_run(problem, params, args.steps, not args.no_progress, args.damping),
      kfac_linesearch_run(problem, params, args.steps, not args.no_progress),
      adam_run(problem, params, args.adam_steps, not args.no_progress, args.adam_lr),
    ]
  finally:
    jax.config.update("jax_enable_x64", previous)
  print("| optimizer | steps | seconds | relative L2 |")
  print("|---|---:|---:|---:|")
  for r in runs:
    print(f"| {r.name} | {r.steps[-1]} | {r.seconds[-1]:.1f} | {r.errors[-1]:.2e} |")
  plot(runs, args.out)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
