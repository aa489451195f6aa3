"""Prototype: `kfac`'s damping adapted from the loss change across steps (no extra forward pass).

Issue 14 asks for an adaptive option for the transform that costs no extra forward pass, kept
if it wins the race. This races one on the autoencoder: the step is the race's (`jax.value_and_grad`,
then `kfac` with statistics from `batch=`), with λ injected by `optax.inject_hyperparams` and
set every `--period` steps from

    ρ = (L_{t+T} − L_t) / Σ_k gₖ·uₖ      (k = t … t+T−1)

the loss change over the last T updates (each update's loss is the one its own step measured,
on its own minibatch) over the change the updates' first-order model predicted. For a step
that minimises the quadratic model the model predicts half of the linear change, so the
Levenberg–Marquardt thresholds 1/4 and 3/4 on the quadratic ρ become 1/8 and 3/8 here:
λ ← λ / ω below 1/8, λ · ω above 3/8, ω = 0.95^T, λ kept in [1e-4, 10]. Reported beside Adam
and the same `kfac` row with a fixed λ (RESULTS.md, "Re-checks on the current code").

    OPENBLAS_NUM_THREADS=1 python benchmarks/profile/adaptive_damping.py --budget 120 --period 20 --dampings 0.1 --trace
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness, race  # noqa: E402

LOW, HIGH, LAMBDA_MIN, LAMBDA_MAX = 0.125, 0.375, 1e-4, 10.0


def adapt(lam, rho, omega):
  """The damping after one adaptation: raised (÷ ω) when the loss fell by less than 1/8 of the
  linear prediction, lowered (· ω) above 3/8, clipped to [LAMBDA_MIN, LAMBDA_MAX]."""
  new = jnp.where(rho < LOW, lam / omega, jnp.where(rho > HIGH, lam * omega, lam))
  return jnp.clip(new, LAMBDA_MIN, LAMBDA_MAX)


def adaptive_contestant(loss_fn, example, damping: float, period: int, trace: bool, **kw):
  tx = optax.inject_hyperparams(kfac_jax.kfac, static_args=("loss_fn", "example_batch"))(
    loss_fn, example, damping=damping, **_harness.with_config(kw)
  )
  omega = 0.95**period

  def init(params):
    zero = lambda: jnp.zeros((), jnp.float32)  # noqa: E731 (distinct buffers: all donated)
    extra = {"k": jnp.zeros((), jnp.int32), "loss": zero(), "pred": zero()}
    return tx.init(params), dict(extra, acc_dl=zero(), acc_pred=zero())

  def step(params, state, batch, rng):
    inner, ad = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    seen = ad["k"] > 0
    acc_dl = ad["acc_dl"] + jnp.where(seen, loss - ad["loss"], 0.0)
    acc_pred = ad["acc_pred"] + jnp.where(seen, ad["pred"], 0.0)
    due = seen & (ad["k"] % period == 0)
    rho = acc_dl / jnp.where(acc_pred < 0, acc_pred, -jnp.finfo(jnp.float32).tiny)
    lam = inner.hyperparams["damping"]
    lam = jnp.where(due, adapt(lam, rho, omega), lam)
    inner.hyperparams["damping"] = lam
    if trace:
      jax.lax.cond(
        due,
        lambda: jax.debug.print(
          "update {k}: rho {r:.3f}, damping {l:.4g}", k=ad["k"], r=rho, l=lam
        ),
        lambda: None,
      )
    updates, inner = tx.update(grads, inner, params, batch=batch, rng=rng)
    ad = {
      "k": ad["k"] + 1,
      "loss": loss,
      "pred": optax.tree.vdot(grads, updates),
      "acc_dl": jnp.where(due, 0.0, acc_dl),
      "acc_pred": jnp.where(due, 0.0, acc_pred),
    }
    return optax.apply_updates(params, updates), (inner, ad), loss

  name = f"kfac, damping adapted every {period} from {damping:g}"
  hyper = {"damping0": damping, "period": period}
  return _harness.Contestant(name, "kfac", init, step, hyper, period=kw["inverse_every"])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--budget", type=float, default=120.0, help="charged seconds per contestant")
  p.add_argument("--period", type=int, default=20, help="updates per adaptation (T)")
  p.add_argument("--dampings", default="0.1", help="initial λ of the adaptive rows")
  p.add_argument("--fixed-damping", type=float, default=0.03, help="λ of the fixed row")
  p.add_argument("--trace", action="store_true", help="print ρ and λ at every adaptation")
  args, rest = p.parse_known_args(argv)
  wl = race.WORKLOADS["autoencoder"].parse_args(
    ["--plot", "", "--num-images", "5000", "--steps", "1999", "--warmup", "1", *rest]
  )
  workload = race.cyclic(race.WORKLOADS["autoencoder"].make_workload(wl), wl.steps + 1)
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  loss_fn = workload.loss_fn
  kw = dict(
    learning_rate=1.0,
    momentum=0.7,
    max_norm=0.3,
    curvature_every=10,
    inverse_every=20,
    preconditioner_dtype="bfloat16",
    ema_decay=0.95,
  )
  contestants = [
    _harness.first_order("Adam", "adam", loss_fn, optax.adam(1e-3)),
    _harness.kfac_transform(
      loss_fn, example, damping=args.fixed_damping, name=f"kfac, λ {args.fixed_damping:g}", **kw
    ),
  ]
  for lam in (float(x) for x in args.dampings.split(",")):
    contestants.append(adaptive_contestant(loss_fn, example, lam, args.period, args.trace, **kw))
  jax.jit(lambda x: x + 1).lower(1.0).compile()
  rows = []
  for c in contestants:
    run = _harness.run_contestant_for_budget(c, workload, args.budget, 0)
    s = run.summary
    rows.append((c.name, len(run.losses), s["final_eval_loss"], s["extra_eval"]))
  print(f"\n{workload.description}; {args.budget:g} charged seconds each\n")
  print("| contestant | steps | loss | squared error |\n|---|---:|---:|---:|")
  for name, steps, loss, extra in rows:
    sq = ", ".join(f"{v:.4g}" for v in extra.values())
    print(f"| {name} | {steps} | {loss:.4g} | {sq} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
