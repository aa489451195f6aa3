"""PINN benchmark: the error at fixed steps and at equal seconds, per optimizer.

Problems (float64, MLP d-64-1 tanh, `examples/pinn_poisson.init_params`, the operators of
`kfac_jax.pinn`, one tag per loss term, each term ½ mean(residual²)):

- `poisson`: −Δu = 2π² sin(πx) sin(πy) on [0, 1]², u = 0 on the boundary (900 interior and 120
  boundary points; `examples/pinn_poisson.py`);
- `poisson-hessian`: the same, the Laplacian the trace of `jax.hessian` at one point, vmapped
  (reverse mode, then forward: each kernel also read transposed);
- `heat`: ∂u/∂t = κ ∂²u/∂x² on [0, 1] × [0, 1], κ = 1/4, u(0, x) = sin(πx), u = 0 at x = 0 and
  x = 1; solution exp(−κπ²t) sin(πx) (900 interior, 120 boundary, 120 initial points);
- `poisson5d`: −Δu = π² Σ cos(πx_i) on [0, 1]⁵, u = Σ cos(πx_i) on the boundary (3,000 interior
  and 500 boundary points, MLP 5-64-1);
- `poisson5d-10k`: the same with the MLP 5-64-64-48-48-1 (10,065 parameters).

Errors on 9,000 uniform points: the relative L2 error ‖u − u*‖ / ‖u*‖ and, in parentheses, the
RMS error √mean((u − u*)²) (the K-FAC for PINNs paper's code logs the RMS). Their ratio is the
solution's own RMS: 1/2 (poisson), 0.32 (heat), 1.58 (poisson5d).

Optimizers: `Optimizer` (`kfac_jax.pinn.optimizer`: learning rate and momentum from the
quadratic model; exact GGN statistics, inverses and damping adaptation at every step), `kfac
grid` and `kfac zoom` (`examples/pinn_poisson.make_kfac`: the optax chain with the paper's
K-FAC settings, its grid line search and a fading damping, or optax's zoom line search and a
fixed damping), `kfac` (the chain, fixed learning rates), `kernel` (`kfac_jax.kernel_ngd`: the
exact damped Gauss-Newton direction over all points, ENGD-Woodbury through the points' kernel,
or ENGD through F when the points outnumber the parameters, with `kfac_jax.pinn.grid_linesearch`
and the damping `--kernel-damping`), Adam (a small learning-rate grid) and L-BFGS
(`optax.lbfgs`, its zoom line search). Each optimizer runs `--steps` steps, the error
measured at every checkpoint (outside the timing); "equal seconds" gives every optimizer the
`Optimizer`'s step time for the last checkpoint and reports the error there. `--only` runs a
subset (by name, or by the names' first word).

    python benchmarks/pinn.py --problem poisson --steps 100,1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from examples import pinn_poisson as pp  # noqa: E402

KAPPA = 0.25
HEAT_A, HEAT_B = np.diag([0.0, -KAPPA]), np.array([1.0, 0.0])  # u_t − κ u_xx on (t, x)


def heat_problem(seed: int = 0):
  """Points `(t, x)`: interior, boundary (x = 0 or 1) and initial (t = 0)."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  interior = jax.random.uniform(k1, (900, 2), jnp.float64)
  tb = jax.random.uniform(k2, (120,), jnp.float64)
  boundary = jnp.stack([tb, (jnp.arange(120) % 2).astype(jnp.float64)], axis=1)
  x0 = jax.random.uniform(k3, (120,), jnp.float64)
  initial = jnp.stack([jnp.zeros_like(x0), x0], axis=1)
  x_eval = jax.random.uniform(k4, (9000, 2), jnp.float64)
  batch = {"interior": interior, "boundary": boundary, "initial": initial}
  return pp.Problem(batch, x_eval, heat_solution(x_eval))


def heat_solution(p):
  return jnp.exp(-KAPPA * jnp.pi**2 * p[:, 0]) * jnp.sin(jnp.pi * p[:, 1])


def heat_loss(params, batch):
  """½ mean((u_t − κ u_xx)²) + ½ mean(u² at x = 0, 1) + ½ mean((u − sin πx)² at t = 0), each
  term tagged as a normal of variance 1 (as `pinn_poisson.loss_fn`)."""
  u = lambda y: pp.mlp(params, y)  # noqa: E731
  residual = kfac_jax.pinn.differential_operator(u, batch["interior"], HEAT_A, HEAT_B)[:, None]
  kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
  ub = pp.mlp(params, batch["boundary"])[:, None]
  kfac_jax.register_normal_predictive_distribution(ub, var=1.0)
  p0 = batch["initial"]
  u0 = (pp.mlp(params, p0) - jnp.sin(jnp.pi * p0[:, 1]))[:, None]
  kfac_jax.register_normal_predictive_distribution(u0, var=1.0)
  return 0.5 * (jnp.mean(residual**2) + jnp.mean(ub**2) + jnp.mean(u0**2))


def hessian_loss(params, batch):
  """`pinn_poisson.loss_fn` with the Laplacian as most PINN code writes it: the trace of
  `jax.hessian` (jacfwd of jacrev) of the network at one point, vmapped over the points."""
  x = batch["interior"]
  u = lambda y: pp.mlp(params, y[None])[0]  # noqa: E731
  laplacian = jax.vmap(lambda y: jnp.trace(jax.hessian(u)(y)))(x)
  residual = (laplacian + pp.source(x))[:, None]
  kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
  ub = pp.mlp(params, batch["boundary"])[:, None]
  kfac_jax.register_normal_predictive_distribution(ub, var=1.0)
  return 0.5 * jnp.mean(residual**2) + 0.5 * jnp.mean(ub**2)


def cos_sum(x):
  return jnp.sum(jnp.cos(jnp.pi * x), axis=-1)


def poisson5d_problem(seed: int = 0, d: int = 5):
  """Uniform interior points; boundary points uniform on a face drawn at random."""
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
  interior = jax.random.uniform(k1, (3000, d), jnp.float64)
  boundary = jax.random.uniform(k2, (500, d), jnp.float64)
  axis = jax.random.randint(k3, (500,), 0, d)
  side = jax.random.bernoulli(k4, 0.5, (500,)).astype(jnp.float64)
  boundary = jnp.where(jnp.arange(d) == axis[:, None], side[:, None], boundary)
  x_eval = jax.random.uniform(k5, (9000, d), jnp.float64)
  return pp.Problem({"interior": interior, "boundary": boundary}, x_eval, cos_sum(x_eval))


def poisson5d_loss(params, batch):
  """½ mean((Δu + π² Σ cos πx_i)²) + ½ mean((u − Σ cos πx_i)² on the boundary)."""
  x = batch["interior"]
  lap = kfac_jax.pinn.laplacian(lambda y: pp.mlp(params, y), x)
  residual = (lap + jnp.pi**2 * cos_sum(x))[:, None]
  kfac_jax.register_normal_predictive_distribution(residual, var=1.0)
  xb = batch["boundary"]
  ub = (pp.mlp(params, xb) - cos_sum(xb))[:, None]
  kfac_jax.register_normal_predictive_distribution(ub, var=1.0)
  return 0.5 * jnp.mean(residual**2) + 0.5 * jnp.mean(ub**2)


PROBLEMS = {  # (points, loss, network sizes)
  "poisson": (pp.make_problem, pp.loss_fn, pp.SIZES),
  "poisson-hessian": (pp.make_problem, hessian_loss, pp.SIZES),
  "heat": (heat_problem, heat_loss, pp.SIZES),
  "poisson5d": (poisson5d_problem, poisson5d_loss, (5, 64, 1)),
  "poisson5d-10k": (poisson5d_problem, poisson5d_loss, (5, 64, 64, 48, 48, 1)),
}


def errors(params, problem):
  """(relative L2 error, RMS error) on the evaluation points."""
  diff = pp.mlp(params, problem.x_eval) - problem.u_eval
  rms = jnp.sqrt(jnp.mean(diff**2))
  return rms / jnp.sqrt(jnp.mean(problem.u_eval**2)), rms


def _timed(step, params, state, problem, checkpoints, budget=None, stop=None):
  """`{step: (seconds, (relative L2, RMS))}` at the checkpoints; with `budget` (seconds), also
  the errors when the cumulative step time first reaches it."""
  step = jax.jit(step)
  error = jax.jit(errors)
  jax.block_until_ready(step(params, state))  # Compile outside the timing.
  out, elapsed, at_budget, t = {}, 0.0, None, 0
  stop = max(checkpoints) if stop is None else stop
  while t < stop or (budget is not None and at_budget is None and t < 10**6):
    t += 1
    start = time.perf_counter()
    params, state = step(params, state)
    jax.block_until_ready(params)
    elapsed += time.perf_counter() - start
    if t in checkpoints:
      out[t] = (elapsed, tuple(map(float, error(params, problem))))
    if budget is not None and at_budget is None and elapsed >= budget:
      at_budget = (t, tuple(map(float, error(params, problem))))
  return out, at_budget


def optimizer_step(loss_fn, problem, params):
  opt = kfac_jax.pinn.optimizer(loss_fn, params, problem.batch)
  rng = jax.random.key(1)
  return (lambda p, s: opt.step(p, s, problem.batch, rng)[:2]), opt.init


def kfac_step(loss_fn, problem, params, lr):
  reg = kfac_jax.Registration(loss_fn, params, problem.batch, estimation_mode="exact_GGN")
  tx = kfac_jax.kfac(
    registration=reg,
    learning_rate=lr,
    ema_decay=0.0,
    damping=1e-3,
    inverse_every=1,
    curvature_every=1,
  )
  rng = jax.random.key(1)

  def step(params, state):
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, problem.batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  return step, tx.init


def kfac_linesearch_step(loss_fn, problem, params, linesearch):
  tx, reg = pp.make_kfac(params, problem.batch, loss_fn, linesearch)
  step = pp.linesearch_step(tx, reg, problem.batch, loss_fn)
  return (lambda p, s: step(p, s)[:2]), tx.init


def kernel_step(loss_fn, problem, params, damping):
  """`kfac_jax.kernel_ngd` on all the points (exact mode: one row per point and loss term),
  its step from the grid line search."""
  reg = kfac_jax.Registration(loss_fn, params, problem.batch, estimation_mode="exact")
  tx = kfac_jax.kernel_ngd(
    registration=reg, damping=damping, linesearch=kfac_jax.pinn.grid_linesearch()
  )
  batch = problem.batch
  value_fn = lambda p: loss_fn(p, batch)  # noqa: E731

  def step(params, state):
    value, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(
      grads, state, params, batch=batch, value=value, grad=grads, value_fn=value_fn
    )
    return optax.apply_updates(params, updates), state

  return step, tx.init


def optax_step(loss_fn, problem, tx):
  def step(params, state):
    value, grads = jax.value_and_grad(loss_fn)(params, problem.batch)
    kw = {}
    if isinstance(state, tuple) and any("LBFGS" in type(s).__name__ for s in state):
      kw = dict(value=value, grad=grads, value_fn=lambda p: loss_fn(p, problem.batch))
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  return step, tx.init


def _cell(errs) -> str:
  return f"{errs[0]:.1e} ({errs[1]:.1e})"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--problem", choices=sorted(PROBLEMS), default="poisson")
  p.add_argument("--steps", default="100,1000", help="checkpoints, comma-separated")
  p.add_argument("--adam-lrs", default="1e-3,3e-3,1e-2")
  p.add_argument("--kfac-lrs", default="0.1,0.3")
  p.add_argument("--kernel-damping", type=float, default=1e-13, help="λ of `kernel`")
  p.add_argument(
    "--lbfgs-steps", type=int, default=100, help="L-BFGS runs to this step at most (slow steps)"
  )
  p.add_argument("--only", default="", help="comma-separated subset of optimizer names")
  p.add_argument("--seed", type=int, default=0, help="the parameters' seed (`init_params`)")
  args = p.parse_args(argv)
  checkpoints = sorted(int(s) for s in args.steps.split(","))
  make, loss_fn, sizes = PROBLEMS[args.problem]
  problem = make(0)
  params = pp.init_params(args.seed, sizes)
  only = set(args.only.split(",")) - {""}
  print(
    f"{args.problem}: jax {jax.__version__}, {os.cpu_count()} CPUs; checkpoints {checkpoints}; "
    "relative L2 (RMS)",
    flush=True,
  )
  contestants = [("Optimizer", lambda: optimizer_step(loss_fn, problem, params))]
  for search in ("grid", "zoom"):
    contestants.append(
      (f"kfac {search}", lambda s=search: kfac_linesearch_step(loss_fn, problem, params, s))
    )
  for lr in (float(x) for x in args.kfac_lrs.split(",") if x):
    contestants.append((f"kfac lr={lr:g}", lambda lr=lr: kfac_step(loss_fn, problem, params, lr)))
  for lr in (float(x) for x in args.adam_lrs.split(",") if x):
    contestants.append(
      (f"Adam lr={lr:g}", lambda lr=lr: optax_step(loss_fn, problem, optax.adam(lr)))
    )
  contestants.append(("kernel", lambda: kernel_step(loss_fn, problem, params, args.kernel_damping)))
  contestants.append(("L-BFGS", lambda: optax_step(loss_fn, problem, optax.lbfgs())))
  budget = None
  for name, build in contestants:
    if only and name not in only and name.split()[0] not in only:
      continue
    step, init = build()
    stop = min(args.lbfgs_steps, max(checkpoints)) if name == "L-BFGS" else None
    marks = set(checkpoints) | ({stop} if stop else set())
    out, at_budget = _timed(step, params, init(params), problem, marks, budget, stop)
    if name == "Optimizer":
      budget = out[max(checkpoints)][0]
    cells = " | ".join(_cell(out[c][1]) if c in out else "–" for c in checkpoints)
    last = max(c for c in out if c <= max(stop or 0, max(checkpoints)))
    eq = "" if at_budget is None else f" | {_cell(at_budget[1])} ({at_budget[0]} steps)"
    print(f"| {name} | {cells} | {out[last][0]:.1f} s to step {last}{eq} |", flush=True)
  if budget is not None:
    print(f"equal seconds: {budget:.1f} s (the Optimizer's {max(checkpoints)} steps)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
