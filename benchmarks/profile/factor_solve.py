"""The two forms of a Kronecker factor's damped inverse (`factor_solve`), timed.

Part 1, one n×n factor multiplying an [n, k] matrix: the refresh (`_linalg.spd_inverse`, the
explicit inverse, against `_linalg.substitution_form`) and one product (a matmul with the
inverse against `_linalg.substitution_solve`), with the break-even number of products per
refresh (the substitution form wins when the inverses are refreshed at least this often).
Part 2, a race workload's estimator: `update_inverses` and `multiply_inverse` with
`factor_solve="never"` and `"auto"`, alternating. Medians of `--repeats` jitted calls; needs a
quiet machine (it measures time).

    python benchmarks/profile/factor_solve.py --workload cnn
    python benchmarks/profile/factor_solve.py --sizes 300x4 --workload none --repeats 2  # quick
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
import numpy as np  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness  # noqa: E402
from kfac_jax.blocks import _linalg  # noqa: E402


def factor_table(sizes, repeats: int) -> None:
  print(
    "| n | k | explicit inverse ms | substitution form ms | matmul ms | substitution ms "
    "| break-even products per refresh | max error |"
  )
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  refresh_inv, refresh_form = jax.jit(_linalg.spd_inverse), jax.jit(_linalg.substitution_form)
  matmul, solve = jax.jit(lambda a, x: a @ x), jax.jit(_linalg.substitution_solve)
  for n, k in sizes:
    rng = np.random.RandomState(n + k)
    r = rng.randn(n, 2 * n).astype(np.float32)
    m = jnp.asarray(r @ r.T / n + 0.1 * np.eye(n, dtype=np.float32))
    x = jnp.asarray(rng.randn(n, k).astype(np.float32))
    inv, form = refresh_inv(m), refresh_form(m)
    t_inv = _harness.median_ms(refresh_inv, m, repeats=repeats)
    t_form = _harness.median_ms(refresh_form, m, repeats=repeats)
    t_mm = _harness.median_ms(matmul, inv, x, repeats=repeats)
    t_sub = _harness.median_ms(solve, form, x, repeats=repeats)
    extra = t_sub - t_mm
    even = f"{(t_inv - t_form) / extra:.0f}" if extra > 0 else "always"
    err = float(jnp.max(jnp.abs(m @ solve(form, x) - x)))
    print(
      f"| {n} | {k} | {t_inv:.1f} | {t_form:.1f} | {t_mm:.2f} | {t_sub:.2f} | {even} | {err:.1e} |"
    )


def workload_table(name: str, repeats: int, rounds: int) -> None:
  from benchmarks import race

  mod = race.WORKLOADS[name]
  wl = mod.make_workload(mod.parse_args(["--plot", ""]))
  batch = jax.tree.map(jnp.asarray, wl.batch_at(0))
  params = wl.params0
  print(f"\n{wl.name}: {wl.description}\n")
  print(
    "| factor_solve | round | update_inverses ms | multiply_inverse ms | kept in substitution form |"
  )
  print("|---|---:|---:|---:|---|")
  for r in range(rounds):
    for mode in ("never", "auto"):
      est = kfac_jax.CurvatureEstimator(
        kfac_jax.Registration(wl.loss_fn, params, batch), config=kfac_jax.Config(factor_solve=mode)
      )
      state = est.init(params)
      fold = jax.jit(lambda s, p, b, key: est.update_curvature(s, p, b, key, 0.0))
      state = fold(state, params, batch, jax.random.key(0))
      refresh = jax.jit(lambda s: est.update_inverses(s, 0.1))
      apply = jax.jit(est.multiply_inverse)
      fresh = refresh(state)
      t_ui = _harness.median_ms(refresh, state, repeats=repeats)
      t_mi = _harness.median_ms(apply, fresh, params, repeats=repeats)
      kept = [
        f"{n}.{side}"
        for n, c in fresh.cache.items()
        for side in ("a", "g")
        if getattr(getattr(c, side, None), "subst", None) is not None
      ]
      print(f"| {mode} | {r + 1} | {t_ui:.1f} | {t_mi:.2f} | {', '.join(kept) or '-'} |")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="300x4,513x10,1001x64,1569x10,1569x128", help="n x k list")
  p.add_argument("--workload", default="cnn", help="a race workload, or 'none'")
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--rounds", type=int, default=2)
  args = p.parse_args(argv)
  sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",") if s]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs)\n")
  factor_table(sizes, args.repeats)
  if args.workload != "none":
    workload_table(args.workload, args.repeats, args.rounds)
  return 0


if __name__ == "__main__":
  sys.exit(main())
