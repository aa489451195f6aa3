"""Small models and loss functions shared by the tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

import kfac_jax


class LinenMLP(nn.Module):
  sizes: tuple = (5, 3)

  @nn.compact
  def __call__(self, x):
    for i, s in enumerate(self.sizes):
      x = nn.Dense(s)(x)
      if i < len(self.sizes) - 1:
        x = jnp.tanh(x)
    return x


class NnxMLP(nnx.Module):
  def __init__(self, din, dhidden, dout, rngs):
    self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
    self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    return self.linear2(jnp.tanh(self.linear1(x)))


def np_rng(seed) -> np.random.Generator:
  """A NumPy generator from an int or a JAX key. Test inputs are drawn on the host: an eager
  `jax.random` sampler compiles a program for each new shape."""
  if isinstance(seed, int):
    return np.random.default_rng(seed)
  return np.random.default_rng(np.asarray(jax.random.key_data(seed)))


def normal(seed, shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
  """Standard normal entries times `scale`, drawn on the host (`np_rng`)."""
  return jax.device_put((scale * np_rng(seed).standard_normal(shape)).astype(dtype))


def integers(seed, low, high, shape) -> jax.Array:
  """Integers in [low, high), drawn on the host (`np_rng`)."""
  return jax.device_put(np_rng(seed).integers(low, high, shape).astype(np.int32))


def jnp_mlp_init(key, sizes, dtype=jnp.float32):
  rng = np_rng(key)
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"layer{i}"] = {
      "w": jax.device_put((rng.standard_normal((a, b)) / np.sqrt(a)).astype(dtype)),
      "b": jax.device_put(np.zeros((b,), dtype)),
    }
  return params


def jnp_mlp_apply(params, x):
  n = sum(1 for k in params if k.startswith("layer"))
  for i in range(n):
    p = params[f"layer{i}"]
    x = x @ p["w"] + p["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def pinn_mlp_init(key, sizes) -> list[dict]:
  """A float64 tanh MLP `[{"w", "b"}, ...]` for PINN tests: weights 1/√fan_in, biases 0.3."""
  params = []
  for a, b in zip(sizes[:-1], sizes[1:]):
    key, k1, k2 = jax.random.split(key, 3)
    w = jax.random.normal(k1, (a, b), jnp.float64) / np.sqrt(a)
    params.append({"w": w, "b": 0.3 * jax.random.normal(k2, (b,), jnp.float64)})
  return params


def pinn_mlp(params, x):
  """The network on points `[..., d]`; one point `[d]` gives a scalar."""
  for i, p in enumerate(params):
    x = x @ p["w"] + p["b"]
    if i < len(params) - 1:
      x = jnp.tanh(x)
  return x[..., 0]


def softmax_loss(apply_fn):
  def loss_fn(params, batch):
    logits = apply_fn(params, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


def classification_batch(key, n=16, din=4, classes=3, dtype=jnp.float32):
  rng = np_rng(key)
  x = rng.standard_normal((n, din)).astype(dtype)
  y = rng.integers(0, classes, (n,)).astype(np.int32)
  return {"x": jax.device_put(x), "y": jax.device_put(y)}


def to_dtype(tree, dtype):
  return jax.tree_util.tree_map(lambda p: p.astype(dtype), tree)


def block_mask(est, params):
  """Boolean [n, n] mask of the estimator's diagonal blocks, in `ravel_pytree(params)` order."""
  sizes = [x.size for x in jax.tree_util.tree_leaves(params)]
  off = np.concatenate([[0], np.cumsum(sizes)])
  mask = np.zeros((off[-1], off[-1]), bool)
  for b in est.blocks:
    idx = np.concatenate([np.arange(off[j], off[j + 1]) for j in b.spec.leaf_indices])
    mask[np.ix_(idx, idx)] = True
  return mask


def all_eqns(jaxpr):
  """Every equation of `jaxpr` and, depth first, of its sub-jaxprs (cond branches, loop bodies,
  nested calls)."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for j in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(j, "jaxpr", j)  # A ClosedJaxpr's, or a Jaxpr.
        if hasattr(inner, "eqns"):
          yield from all_eqns(inner)


def sampling_inside_conds(jaxpr) -> bool:
  """Whether a random draw (the statistics' sampled targets) happens inside a `cond`."""
  return any(
    "random" in inner.primitive.name or "threefry" in inner.primitive.name
    for e in all_eqns(jaxpr)
    if e.primitive.name == "cond"
    for branch in e.params["branches"]
    for inner in all_eqns(branch.jaxpr)
  )


def with_config(kw: dict) -> dict:
  """`kw` with the keywords that are `kfac_jax.Config` fields moved into `config=` (built lazily
  by the front's call, so a bad field raises there)."""
  fields = set(kfac_jax.Config.__dataclass_fields__) | {"inverse_mesh"}
  moved = {("mesh" if k == "inverse_mesh" else k): kw[k] for k in kw if k in fields}
  if not moved:
    return kw
  rest = {k: v for k, v in kw.items() if k not in fields}
  return {**rest, "config": kfac_jax.Config(**moved)}


REGISTRATION_KNOBS = ("has_aux", "estimation_mode", "num_samples", "layers", "strict", "check_loss")


def front_args(loss_fn, params, batch, kw: dict) -> tuple[tuple, dict]:
  """`(args, kwargs)` for a front (`scale_by_kfac`, `kfac`, `Optimizer`): `(loss_fn, batch)` and
  `kw` with its `Config` fields moved into `config=`; with a registration setting in `kw`,
  `registration=kfac_jax.Registration(loss_fn, params, batch, <settings>)` instead of the
  positionals."""
  settings = {k: v for k, v in kw.items() if k in REGISTRATION_KNOBS}
  rest = with_config({k: v for k, v in kw.items() if k not in REGISTRATION_KNOBS})
  if not settings:
    return (loss_fn, batch), rest
  return (), {"registration": kfac_jax.Registration(loss_fn, params, batch, **settings), **rest}


def device_bytes(tree, mesh) -> list[int]:
  """The bytes of `tree`'s arrays each device of `mesh` holds (its addressable shards)."""
  return [
    sum(
      s.data.nbytes
      for x in jax.tree_util.tree_leaves(tree)
      for s in x.addressable_shards
      if s.device == dev
    )
    for dev in mesh.devices.flat
  ]


def empirical_run(tx, loss_fn, params, batch, steps: int):
  """`steps` jitted updates of `tx` on one `batch` from `tx.init(params)`, with the empirical
  statistics of `kfac_jax.value_and_grad`: the run the data-parallel and storage tests compare
  with. Returns the last params and state."""

  @jax.jit
  def step(params, state, batch):
    reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical")
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state, batch)
  return params, state


def jit_jacobian(fn, *args, **kwargs):
  """`jax.jacobian` compiled as one program: called eagerly, its many small operations would
  each compile on their own."""
  return jax.jit(jax.jacobian(fn, *args, **kwargs))


def flat_jacobian(fn, params) -> np.ndarray:
  """The Jacobian of `fn(params)` in the flat parameters (`ravel_pytree` order), ravelled and
  differentiated in one program (see `jit_jacobian`)."""

  @jax.jit
  def jac(params):
    flat, unravel = ravel_pytree(params)
    return jax.jacobian(lambda f: fn(unravel(f)))(flat)

  return np.asarray(jac(params))


def jit_hessian(fn, *args, **kwargs):
  """`jax.hessian` compiled as one program (see `jit_jacobian`)."""
  return jax.jit(jax.hessian(fn, *args, **kwargs))
