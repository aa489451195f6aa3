"""Variational Monte Carlo: a FermiNet-class wave function trained with K-FAC on small atoms.

The wave function has FermiNet's parts at a small size: a one-electron stream (features of each
electron relative to the nuclei) and a two-electron stream (features of each electron pair),
mixed at every layer by averages over the electrons of each spin; per spin, orbitals from a
dense layer, multiplied by an exponential envelope around each nucleus, and a sum of
determinants. The envelope is isotropic (a decay rate per atom and orbital) or, with
`--envelope anisotropic`, FermiNet's anisotropic one: per atom and orbital a 3x3 matrix applied
to the electron's vector to that atom, `einsum("bnai,ijak->bnajk", r - R, sigma)`, which K-FAC
reads as a dense layer per atom (Kronecker within an atom, block-diagonal over atoms).
log|ψ| is evaluated for a batch of walkers `[B, n, 3]`, so the dense layers act on `[B, n, d]`
(electrons) and `[B, n, n, d]` (pairs) inputs.

Training is variational Monte Carlo. Walkers are moved by Metropolis steps that sample |ψ|²;
the local energy E_L = −½ (∇² log|ψ| + |∇ log|ψ||²) + V uses a Laplacian by forward-over-reverse
differentiation; the loss is the mean local energy, a `jax.custom_jvp` whose rule is the VMC
gradient 2 E[(E_L − E) ∇ log|ψ|] (local energies clipped at 5 mean absolute deviations) and
which registers the curvature there, `register_normal_predictive_distribution(log_psi[:, None])`
(the Fisher of |ψ|²). That is FermiNet's loss written as is: K-FAC finds the tag in the rule,
takes the gradient from the rule and the layers from log|ψ|. SPRING (`kfac_jax.kernel_ngd`)
takes the same gradient and the exact natural gradient over the walkers from a `curvature_fn`
that tags log|ψ|.

    python examples/vmc.py                         # He, K-FAC (the Optimizer), ~1 minute on a CPU
    python examples/vmc.py --steps 1000 --walkers 512   # He within 1 mHa of exact
    python examples/vmc.py --system Li --optimizer kfac --steps 300
    python examples/vmc.py --system LiH --optimizer adam
    python examples/vmc.py --optimizer spring     # SPRING, the kernel natural gradient

Energies are in Hartree; the printed estimate is the mean ± standard error of the loss over the
last 20% of the steps (the walkers are correlated from step to step: the error is a lower
bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class System:
  """Nuclear positions (Bohr), charges and electrons per spin."""

  atoms: tuple[tuple[float, float, float], ...]
  charges: tuple[float, ...]
  spins: tuple[int, int]
  exact: float  # Hartree, for reference.


SYSTEMS = {
  "He": System(((0.0, 0.0, 0.0),), (2.0,), (1, 1), -2.90372),
  "Li": System(((0.0, 0.0, 0.0),), (3.0,), (2, 1), -7.47806),
  "LiH": System(((0.0, 0.0, 0.0), (3.015, 0.0, 0.0)), (3.0, 1.0), (2, 2), -8.07055),
}


@dataclasses.dataclass(frozen=True)
class Net:
  """Widths of the one- and two-electron streams, their layers and the determinants."""

  one: int = 16
  two: int = 4
  layers: int = 2
  determinants: int = 2
  envelope: str = "isotropic"  # or "anisotropic": `sigma` is [3, 3, atoms, orbitals]


# -- the wave function --------------------------------------------------------------------------


def _dense_init(key, din, dout):
  return {"w": jax.random.normal(key, (din, dout)) / np.sqrt(din), "b": jnp.zeros(dout)}


def init_params(key, system: System, net: Net) -> dict[str, Any]:
  """Parameters: per layer a one-electron and (but the last) a two-electron dense layer; per
  spin an orbital layer and the envelope's decay rates `sigma` and weights `pi`, both
  `[atoms, orbitals]` (`sigma` `[3, 3, atoms, orbitals]`, identities, when anisotropic)."""
  n_atoms, keys = len(system.atoms), iter(jax.random.split(key, 4 * net.layers + 8))
  n_spins = sum(1 for s in system.spins if s)
  one_in, two_in = 4 * n_atoms, 4
  layers = []
  for i in range(net.layers):
    mixed = one_in + n_spins * (one_in + two_in)  # own, spin averages of one and two streams
    layer = {"one": _dense_init(next(keys), mixed, net.one)}
    if i < net.layers - 1:  # The last layer's pair stream would feed nothing.
      layer["two"] = _dense_init(next(keys), two_in, net.two)
    layers.append(layer)
    one_in, two_in = net.one, net.two
  orbitals = {}
  for spin, n in zip(("up", "down"), system.spins):
    if n:
      k = net.determinants * n
      orbitals[spin] = {
        "dense": _dense_init(next(keys), one_in, k),
        "sigma": (
          jnp.ones((n_atoms, k))
          if net.envelope == "isotropic"
          else jnp.broadcast_to(jnp.eye(3)[:, :, None, None], (3, 3, n_atoms, k))
        ),
        "pi": jnp.ones((n_atoms, k)),
      }
  return {"layers": layers, "orbitals": orbitals}


def _features(r, atoms):
  """One-electron `[B, n, 4 atoms]` and two-electron `[B, n, n, 4]` inputs, `r - R`
  `[B, n, A, 3]` and `|r - R|` `[B, n, A]`."""
  ae = r[:, :, None, :] - atoms[None, None]  # [B, n, A, 3]
  r_ae = jnp.linalg.norm(ae, axis=-1, keepdims=True)  # [B, n, A, 1]
  one = jnp.concatenate([ae, r_ae], -1).reshape(r.shape[:2] + (-1,))
  n = r.shape[1]
  eye = jnp.eye(n)[None, :, :, None]
  ee = r[:, :, None, :] - r[:, None, :, :]  # [B, n, n, 3]
  r_ee = jnp.linalg.norm(ee + eye, axis=-1, keepdims=True) * (1.0 - eye)  # no 0/0 on the diagonal
  return one, jnp.concatenate([ee, r_ee], -1), ae, r_ae[..., 0]


def _mix(one, two, spins):
  """Each electron's own features, the per-spin means of the one-electron stream and its
  per-spin means over the pair stream: `[B, n, d1 + spins (d1 + d2)]`."""
  parts, start = [one], 0
  for n in spins:
    if n:
      mean_one = jnp.mean(one[:, start : start + n], axis=1, keepdims=True)
      parts.append(jnp.broadcast_to(mean_one, one.shape[:2] + mean_one.shape[2:]))
      parts.append(jnp.mean(two[:, :, start : start + n], axis=2))
    start += n
  return jnp.concatenate(parts, -1)


def log_psi(params, r, atoms, spins: tuple[int, int]):
  """log|ψ| of a batch of walkers `r: [B, n, 3]`; `atoms: [A, 3]` is shared by every walker."""
  one, two, ae, r_ae = _features(r, atoms)
  for layer in params["layers"]:
    mixed = _mix(one, two, spins)
    new_one = jnp.tanh(mixed @ layer["one"]["w"] + layer["one"]["b"])
    one = new_one + one if new_one.shape == one.shape else new_one
    if "two" in layer:
      new_two = jnp.tanh(two @ layer["two"]["w"] + layer["two"]["b"])
      two = new_two + two if new_two.shape == two.shape else new_two
  log_det, signs, start = 0.0, 1.0, 0
  for spin, n in zip(("up", "down"), spins):
    if not n:
      continue
    p = params["orbitals"][spin]
    h = one[:, start : start + n]  # [B, n, d]
    orb = h @ p["dense"]["w"] + p["dense"]["b"]  # [B, n, K n]
    if p["sigma"].ndim == 2:
      decay = jnp.exp(-r_ae[:, start : start + n, :, None] * p["sigma"])  # [B, n, A, K n]
    else:  # Per atom and orbital, |Σ_ak (r - R_a)|: [B, n, A, 3, K n] -> [B, n, A, K n].
      scaled = jnp.einsum("bnai,ijak->bnajk", ae[:, start : start + n], p["sigma"])
      decay = jnp.exp(-jnp.linalg.norm(scaled, axis=3))
    orb = orb * jnp.sum(decay * p["pi"], axis=2)
    orb = orb.reshape(orb.shape[:2] + (-1, n)).transpose(0, 2, 1, 3)  # [B, K, n, n]
    sign, logdet = jnp.linalg.slogdet(orb)
    log_det = log_det + logdet
    signs = signs * sign
    start += n
  top = jnp.max(log_det, axis=-1, keepdims=True)
  return top[:, 0] + jnp.log(jnp.abs(jnp.sum(signs * jnp.exp(log_det - top), axis=-1)))


def potential(r, atoms, charges):
  """Coulomb energy of walkers `[B, n, 3]`: electron-nucleus, electron-electron, nuclear."""
  r_ae = jnp.linalg.norm(r[:, :, None] - atoms, axis=-1)
  n = r.shape[1]
  i, j = np.triu_indices(n, 1)
  r_ee = jnp.linalg.norm(r[:, i] - r[:, j], axis=-1)
  a, b = np.triu_indices(len(charges), 1)
  r_nn = jnp.linalg.norm(atoms[a] - atoms[b], axis=-1)
  v_nn = jnp.sum(charges[a] * charges[b] / r_nn) if len(a) else 0.0
  return -jnp.sum(charges / r_ae, axis=(1, 2)) + jnp.sum(1.0 / r_ee, axis=1) + v_nn


def local_energy(params, r, atoms, charges, spins):
  """E_L per walker; the Laplacian of log|ψ| as the trace of its Hessian, each column a
  forward-mode derivative of the gradient (forward over reverse)."""
  shape = r.shape[1:]

  def f(x):
    return log_psi(params, x.reshape((1,) + shape), atoms, spins)[0]

  def kinetic(x):
    grad = jax.grad(f)
    g = grad(x)
    cols = jax.vmap(lambda e: jax.jvp(grad, (x,), (e,))[1])(jnp.eye(x.size, dtype=x.dtype))
    return -0.5 * (jnp.trace(cols) + g @ g)

  return jax.vmap(kinetic)(r.reshape(r.shape[0], -1)) + potential(r, atoms, charges)


def make_loss(system: System):
  """`loss_fn(params, batch) -> E`, FermiNet's form: a custom_jvp whose rule is the VMC
  gradient and registers the normal tag on log|ψ|. `batch = {"r": [B, n, 3], "atoms": [A, 3]}`
  (the nuclei carry no walker axis)."""
  charges = jnp.asarray(system.charges)

  @jax.custom_jvp
  def energy(params, batch):
    return jnp.mean(local_energy(params, batch["r"], batch["atoms"], charges, system.spins))

  @energy.defjvp
  def energy_jvp(primals, tangents):
    params, batch = primals
    e_l = local_energy(params, batch["r"], batch["atoms"], charges, system.spins)
    e = jnp.mean(e_l)
    spread = 5.0 * jnp.mean(jnp.abs(e_l - jnp.median(e_l)))
    clipped = jnp.clip(e_l, jnp.median(e_l) - spread, jnp.median(e_l) + spread)
    psi, psi_dot = jax.jvp(
      lambda p: log_psi(p, batch["r"], batch["atoms"], system.spins), (params,), (tangents[0],)
    )
    kfac_jax.register_normal_predictive_distribution(psi[:, None])
    return e, 2.0 * jnp.mean((clipped - jnp.mean(clipped)) * psi_dot)

  return energy


# -- sampling -----------------------------------------------------------------------------------


def init_walkers(key, system: System, batch: int):
  """Electrons around the nuclei, each nucleus taking as many as its charge."""
  owners = [a for a, z in enumerate(system.charges) for _ in range(int(z))][: sum(system.spins)]
  centres = jnp.asarray(system.atoms)[jnp.asarray(owners)]
  return centres + jax.random.normal(key, (batch,) + centres.shape)


def mcmc(key, params, r, atoms, spins, width, steps: int):
  """`steps` Metropolis moves of every walker under |ψ|²; returns walkers, acceptance rate."""

  def move(carry, key):
    r, lp, accepted = carry
    k1, k2 = jax.random.split(key)
    proposal = r + width * jax.random.normal(k1, r.shape)
    lp_new = log_psi(params, proposal, atoms, spins)
    accept = jnp.log(jax.random.uniform(k2, lp.shape)) < 2.0 * (lp_new - lp)
    r = jnp.where(accept[:, None, None], proposal, r)
    return (r, jnp.where(accept, lp_new, lp), accepted + jnp.mean(accept)), None

  lp = log_psi(params, r, atoms, spins)
  (r, _, accepted), _ = jax.lax.scan(move, (r, lp, 0.0), jax.random.split(key, steps))
  return r, accepted / steps


# -- training -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spring:
  """SPRING's settings (`kfac_jax.kernel_ngd`): the initial learning rate (decayed by the
  schedule), the momentum μ, the damping λ, the cap on the step's squared length and the
  metric (the scores' covariance when `center`, else the uncentred Fisher of |ψ|²). The
  defaults suit runs of hundreds of steps on He, Li and LiH; a momentum of 0.9 left LiH at
  width 32 far behind, its walkers seeing a twentieth of the parameters while the rest carries
  the last direction. `PAPER_SPRING` is the paper's setting, made for runs of 10⁵ steps."""

  learning_rate: float = 0.3
  momentum: float = 0.5
  damping: float = 1e-2
  norm_constraint: float | None = 0.1
  center: bool = True


PAPER_SPRING = Spring(learning_rate=0.02, momentum=0.99, damping=1e-3, norm_constraint=1e-3)


def train(
  system: System,
  net: Net,
  optimizer: str | Callable,
  *,
  steps: int,
  walkers: int,
  mcmc_steps: int = 10,
  learning_rate: float = 0.05,
  decay: float = 1000.0,
  damping: float = 1e-3,
  spring: Spring | None = None,
  seconds: float | None = None,
  seed: int = 0,
  log_every: int = 0,
) -> dict[str, Any]:
  """Trains with `optimizer` and returns the per-step energies and times.

  `optimizer` is "optimizer" (`kfac_jax.Optimizer`), "kfac" (the optax chain), "spring"
  (`kfac_jax.kernel_ngd` with the settings `spring`, `Spring()` by default), "adam", or a
  callable `make(loss_fn, params, batch, schedule, damping, key) -> (step, state)` whose
  `step(params, state, batch, key) -> (params, state, energy)` is called once per iteration,
  so that another optimizer trains in this same loop (benchmarks/upstream/vmc_worker.py). The
  learning rate is `learning_rate / (1 + t / decay)`, FermiNet's schedule (SPRING's initial
  rate and damping are its own). With `seconds`, the loop goes on past `steps` until the
  iterations' time (`charged_seconds`) reaches it. `times` are whole iterations (sampling
  included), `update_times` the optimizer's step alone.
  """
  if optimizer == "spring":
    spring = spring or Spring()
    learning_rate, damping = spring.learning_rate, spring.damping
  key = jax.random.key(seed)
  k_params, k_walkers, key = jax.random.split(key, 3)
  params = init_params(k_params, system, net)
  atoms = jnp.asarray(system.atoms)
  r = init_walkers(k_walkers, system, walkers)
  width = 0.3
  burn = jax.jit(functools.partial(mcmc, spins=system.spins, steps=100))
  key, sub = jax.random.split(key)
  r, _ = burn(sub, params, r, atoms, width=width)
  batch = {"r": r, "atoms": atoms}
  loss_fn = make_loss(system)
  schedule = lambda t: learning_rate / (1.0 + t / decay)  # noqa: E731
  sample = jax.jit(functools.partial(mcmc, spins=system.spins, steps=mcmc_steps))

  if callable(optimizer):
    key, sub = jax.random.split(key)
    step, state = optimizer(loss_fn, params, batch, schedule, damping, sub)
  elif optimizer == "optimizer":
    opt = kfac_jax.Optimizer(
      loss_fn,
      batch,
      learning_rate=schedule,
      momentum=0.0,
      use_adaptive_damping=False,
      norm_constraint=1e-3,
      inverse_every=1,
    )
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch, key):
      # FermiNet's loop passes the damping each step.
      params, state, info = opt.step(params, state, batch, key, damping=damping)
      return params, state, info["loss"]

  elif optimizer == "spring":

    def curvature_fn(params, batch):  # The Fisher of |ψ|², from log|ψ| alone.
      log_abs_psi = log_psi(params, batch["r"], batch["atoms"], system.spins)
      kfac_jax.register_normal_predictive_distribution(log_abs_psi[:, None])

    reg = kfac_jax.Registration(
      loss_fn, params, batch, curvature_fn=curvature_fn, estimation_mode="exact"
    )
    tx = kfac_jax.kernel_ngd(
      registration=reg,
      learning_rate=schedule,
      momentum=spring.momentum,
      damping=damping,
      norm_constraint=spring.norm_constraint,
      center=spring.center,
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch, key):
      del key  # The exact mode draws nothing.
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
      return optax.apply_updates(params, updates), state, loss

  elif optimizer in ("kfac", "adam"):
    if optimizer == "kfac":
      reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="gradients")
      tx = kfac_jax.kfac(
        registration=reg,
        learning_rate=schedule,
        momentum=0.0,
        damping=damping,
        max_norm=1.0,
        inverse_every=1,
        curvature_every=1,
      )
      grad_fn = kfac_jax.value_and_grad(registration=reg)
    else:
      tx = optax.adam(3e-3)
      grad_fn = lambda p, b, k: (*jax.value_and_grad(loss_fn)(p, b), None)  # noqa: E731
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch, key):
      loss, grads, stats = grad_fn(params, batch, key)
      extra = {} if stats is None else {"curvature_stats": stats}
      updates, state = tx.update(grads, state, params, **extra)
      return optax.apply_updates(params, updates), state, loss

  else:
    raise ValueError(
      f"`optimizer` must be 'optimizer', 'kfac', 'spring', 'adam' or a callable, got {optimizer!r}."
    )

  energies, times, update_times, accept = [], [], [], 0.0
  t = 0
  while t < steps or (seconds is not None and charged_seconds(times)[-1] < seconds):
    key, k_mcmc, k_step = jax.random.split(key, 3)
    start = time.perf_counter()
    r, accept = jax.block_until_ready(sample(k_mcmc, params, batch["r"], atoms, width=width))
    batch = {"r": r, "atoms": atoms}
    sampled = time.perf_counter()
    params, state, loss = step(params, state, batch, k_step)
    loss = float(loss)
    times.append(time.perf_counter() - start)
    update_times.append(time.perf_counter() - sampled)
    energies.append(loss)
    # Keep the acceptance near one half.
    width = width * 1.1 if accept > 0.55 else width / 1.1 if accept < 0.45 else width
    if log_every and (t % log_every == 0 or t == steps - 1):
      print(f"step {t:5d}  energy {loss:+.5f}  acceptance {float(accept):.2f}", flush=True)
    t += 1
  return {
    "energies": np.asarray(energies),
    "times": np.asarray(times),
    "update_times": np.asarray(update_times),
    "params": params,
  }


WARMUP = 5  # The first iterations compile.


def charged_seconds(times) -> np.ndarray:
  """The cumulative time of the iterations, the first `WARMUP` (which compile) charged at the
  median of the others."""
  times = np.asarray(times, float)
  if times.size == 0:
    return np.zeros(1)
  rest = times[WARMUP:] if times.size > WARMUP else times
  return np.cumsum(np.where(np.arange(times.size) < WARMUP, np.median(rest), times))


def estimate(energies: np.ndarray, fraction: float = 0.2) -> tuple[float, float]:
  """Mean and standard error of the last `fraction` of the per-step energies."""
  tail = np.asarray(energies)[-max(2, int(len(energies) * fraction)) :]
  return float(tail.mean()), float(tail.std(ddof=1) / np.sqrt(len(tail)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--system", choices=sorted(SYSTEMS), default="He")
  parser.add_argument(
    "--optimizer", choices=("optimizer", "kfac", "spring", "adam"), default="optimizer"
  )
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--walkers", type=int, default=128)
  parser.add_argument("--width", type=int, default=16, help="one-electron stream width")
  parser.add_argument("--envelope", choices=("isotropic", "anisotropic"), default="isotropic")
  parser.add_argument("--fast", action="store_true", help="a tiny run, for tests")
  args = parser.parse_args(argv)
  system = SYSTEMS[args.system]
  net = Net(one=args.width, envelope=args.envelope)
  steps, walkers = args.steps, args.walkers
  if args.fast:
    net = Net(one=8, two=4, layers=1, determinants=1, envelope=args.envelope)
    steps, walkers = 6, 16
  out = train(
    system, net, args.optimizer, steps=steps, walkers=walkers, log_every=max(1, steps // 10)
  )
  mean, err = estimate(out["energies"])
  print(
    f"{args.system} with {args.optimizer}: E = {mean:.4f} ± {err:.4f} Ha over the last 20% of "
    f"{steps} steps (exact {system.exact}); median step {np.median(out['times']) * 1e3:.0f} ms"
  )
  return out


if __name__ == "__main__":
  main()
