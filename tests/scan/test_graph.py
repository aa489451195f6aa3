"""The scanner sees through JAX transformations: each model written with a transformation
registers the same layers, and gives the same preconditioned gradient (float64, exact mode), as
the same model written plainly (separate leaves, a Python loop)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models

N, D, L, C = 6, 4, 3, 3


def _head(w_out, h, y):
  logits = h @ w_out
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(seed=0):
  """Drawn on the host (as `_layers`): float64 under x64, float32 without it (`device_put`)."""
  rng = _models.np_rng(seed)
  return jax.device_put(
    {"x": rng.standard_normal((N, D)), "y": rng.integers(0, C, N).astype(np.int32)}
  )


def _layers(seed=1, n=L):
  rng = _models.np_rng(seed)
  layers = [
    {"w": 0.7 * rng.standard_normal((D, D)), "b": 0.1 * rng.standard_normal(D)} for _ in range(n)
  ]
  return jax.device_put((layers, rng.standard_normal((D, C))))


@jax.jit
def _stack(trees):
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def _precondition(loss_fn, params, batch):
  """(layers, preconditioned gradient) from the exact-mode estimator, strict registration."""
  # `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it
  # would only compile another program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", strict=True, check_loss=False
    )
  )

  @jax.jit  # One program: called eagerly, each small operation compiles on its own.
  def run(p, b):
    state = est.update_curvature(est.init(p), p, b, None, ema_decay=0.0)
    state = est.update_inverses(state, damping=1e-2)
    return est.multiply_matpower(state, jax.grad(loss_fn)(p, b), -1)

  return est.layers, run(params, batch)


def _signature(layers):
  """Per layer: kind, approximation and factor shapes, a stack of L counted as L layers."""
  out = []
  for s in layers:
    inner = s.stack_inner if s.stack_size else s
    out += [(inner.kind, inner.approx, inner.factor_shapes)] * max(s.stack_size, 1)
  return sorted(out)


def _assert_close(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-8, atol=1e-10)


def _assert_same(transformed, plain, to_plain):
  """`transformed = (loss_fn, params)` against `plain`; `to_plain` maps the first's gradient
  pytree onto the second's structure."""
  batch = _batch()
  layers_t, ng_t = _precondition(*transformed, batch)
  layers_p, ng_p = _precondition(*plain, batch)
  assert _signature(layers_t) == _signature(layers_p)
  assert not any(s.kind == "generic" for s in layers_t)
  _assert_close(to_plain(ng_t), ng_p)
  return layers_t


# -- remat, custom derivatives, nested jit ------------------------------------------------------


def _mlp_loss(block):
  def loss_fn(p, b):
    h = b["x"]
    for layer in p["layers"]:
      h = block(layer["w"], layer["b"], h)
    return _head(p["out"], h, b["y"])

  return loss_fn


def _block(w, b, x):
  return jnp.tanh(x @ w + b)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_remat(x64, policy):
  layers, out = _layers()
  params = {"layers": layers, "out": out}
  remat = jax.checkpoint(_block, policy=policy)
  _assert_same((_mlp_loss(remat), params), (_mlp_loss(_block), params), lambda g: g)
  # The program that runs keeps the remat (one checkpoint region per block).
  batch = _batch()
  tapped = kfac_jax.value_and_grad(
    registration=kfac_jax.Registration(
      _mlp_loss(remat), params, batch, estimation_mode="exact", check_loss=False
    )
  )
  jaxpr = jax.make_jaxpr(lambda p: tapped(p, batch))(params)
  assert str(jaxpr).count("remat") >= L
  # The tapped evaluation through the checkpoint regions gives the loss and gradient exactly.
  loss, grads, _ = jax.jit(tapped)(params, batch)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(_mlp_loss(_block)))(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
  _assert_close(grads, ref_grads)
  plain = jax.make_jaxpr(
    lambda p: kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        _mlp_loss(_block), params, batch, estimation_mode="exact", check_loss=False
      )
    )(p, batch)
  )(params)
  assert "remat" not in str(plain)


def test_linen_remat(x64):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
      return jnp.tanh(nn.Dense(D)(h))

  class Net(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
      cls = nn.remat(Block) if self.remat else Block
      for i in range(L):
        x = cls(name=f"b{i}")(x)
      return nn.Dense(C, use_bias=False, name="out")(x)

  batch = _batch()
  params = Net(False).init(jax.random.key(0), batch["x"])

  def loss(remat):
    return lambda p, b: _head(jnp.eye(C), Net(remat).apply(p, b["x"]), b["y"])

  _assert_same((loss(True), params), (loss(False), params), lambda g: g)


def test_custom_vjp_layer(x64):
  """A layer under `jax.custom_vjp` (found inside; its rule here is the primal's derivative), and
  a custom_jvp activation reading no parameter (kept opaque)."""

  @jax.custom_vjp
  def dense(w, b, x):
    return x @ w + b

  def fwd(w, b, x):
    return dense(w, b, x), (w, x)

  def bwd(res, ct):
    w, x = res
    return x.T @ ct, ct.sum(0), ct @ w.T

  dense.defvjp(fwd, bwd)
  layers, out = _layers()
  params = {"layers": layers, "out": out}
  custom = lambda w, b, x: jax.nn.gelu(dense(w, b, x))
  plain = lambda w, b, x: jax.nn.gelu(x @ w + b)
  _assert_same((_mlp_loss(custom), params), (_mlp_loss(plain), params), lambda g: g)


def test_nested_jit(x64):
  layers, out = _layers()
  params = {"layers": layers, "out": out}
  jitted = jax.jit(lambda w, b, x: jax.jit(_block)(w, b, x))
  _assert_same((_mlp_loss(jitted), params), (_mlp_loss(_block), params), lambda g: g)


# -- stacked layers -----------------------------------------------------------------------------


def test_lax_scan_over_stacked_pytree(x64):
  layers, out = _layers()

  def scanned(p, b):
    h, _ = jax.lax.scan(lambda h, l: (_block(l["w"], l["b"], h), None), b["x"], p["stack"])
    return _head(p["out"], h, b["y"])

  found = _assert_same(
    (scanned, {"stack": _stack(layers), "out": out}),
    (_mlp_loss(_block), {"layers": layers, "out": out}),
    lambda g: {
      "layers": [jax.tree_util.tree_map(lambda x, i=i: x[i], g["stack"]) for i in range(L)],
      "out": g["out"],
    },
  )
  stacked = next(s for s in found if s.stack_size)
  assert stacked.factor_shapes == ((L, D + 1, D + 1), (L, D, D))


def test_reverse_lax_scan_over_stacked_pytree(x64):
  """`lax.scan(reverse=True)` reads the stack from its end: the last slice is the first layer."""
  layers, out = _layers()

  def scanned(p, b):
    step = lambda h, l: (_block(l["w"], l["b"], h), None)  # noqa: E731
    h, _ = jax.lax.scan(step, b["x"], p["stack"], reverse=True)
    return _head(p["out"], h, b["y"])

  found = _assert_same(
    (scanned, {"stack": _stack(layers), "out": out}),
    (_mlp_loss(_block), {"layers": layers[::-1], "out": out}),
    lambda g: {
      "layers": [jax.tree_util.tree_map(lambda x, i=i: x[i], g["stack"]) for i in range(L)][::-1],
      "out": g["out"],
    },
  )
  assert any(s.stack_size == L for s in found)


def test_linen_scan_with_remat(x64):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return h + nn.Dense(D)(nn.LayerNorm()(h)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(
        nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=L
      )
      return stack(name="stack")(x, None)[0]

  class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(L):
        x = Block(name=f"b{i}")(x, None)[0]
      return x

  batch = _batch()
  params = Scanned().init(jax.random.key(3), batch["x"])
  per_layer = {
    "params": {
      f"b{i}": jax.tree_util.tree_map(lambda x, i=i: x[i], params["params"]["stack"])
      for i in range(L)
    }
  }
  out = _layers()[1]

  def loss(model):
    return lambda p, b: _head(p["out"], model.apply(p["model"], b["x"]), b["y"])

  def to_plain(g):
    return {
      "model": {
        "params": {
          f"b{i}": jax.tree_util.tree_map(lambda x, i=i: x[i], g["model"]["params"]["stack"])
          for i in range(L)
        }
      },
      "out": g["out"],
    }

  found = _assert_same(
    (loss(Scanned()), {"model": params, "out": out}),
    (loss(Unrolled()), {"model": per_layer, "out": out}),
    to_plain,
  )
  assert {s.kind for s in found if s.stack_size} == {"dense", "scale_and_shift"}


def test_vmapped_ensemble(x64):
  """`jax.vmap` of a layer over stacked parameters, on one shared input."""
  layers, out = _layers()

  def ensemble(p, b):
    hs = jax.vmap(lambda l: _block(l["w"], l["b"], b["x"]))(p["stack"])
    return _head(p["out"], hs.mean(0), b["y"])

  def loop(p, b):
    hs = [_block(l["w"], l["b"], b["x"]) for l in p["layers"]]
    return _head(p["out"], sum(hs) / L, b["y"])

  _assert_same(
    (ensemble, {"stack": _stack(layers), "out": out}),
    (loop, {"layers": layers, "out": out}),
    lambda g: {
      "layers": [jax.tree_util.tree_map(lambda x, i=i: x[i], g["stack"]) for i in range(L)],
      "out": g["out"],
    },
  )


def test_vmapped_ensemble_on_per_member_inputs(x64):
  layers, out = _layers()
  scales = jnp.arange(1.0, L + 1.0)

  def ensemble(p, b):
    xs = scales[:, None, None] * b["x"]
    hs = jax.vmap(lambda l, x: _block(l["w"], l["b"], x))(p["stack"], xs)
    return _head(p["out"], hs.mean(0), b["y"])

  def loop(p, b):
    hs = [_block(l["w"], l["b"], s * b["x"]) for l, s in zip(p["layers"], scales)]
    return _head(p["out"], sum(hs) / L, b["y"])

  _assert_same(
    (ensemble, {"stack": _stack(layers), "out": out}),
    (loop, {"layers": layers, "out": out}),
    lambda g: {
      "layers": [jax.tree_util.tree_map(lambda x, i=i: x[i], g["stack"]) for i in range(L)],
      "out": g["out"],
    },
  )


def test_mixture_of_experts_einsum(x64):
  """Experts `[E, d, f]` applied by one einsum to their dispatched tokens `[E, capacity, d]`."""
  layers, out = _layers()
  kernels = jnp.stack([l["w"] for l in layers])
  dispatch = jax.nn.one_hot(jnp.arange(N) % L, L)  # [N, E]: token n goes to expert n % E.

  def moe(p, b):
    xe = jnp.einsum("ne,nd->end", dispatch, b["x"])  # [E, N, d]
    ye = jnp.tanh(jnp.einsum("end,edf->enf", xe, p["experts"]))
    return _head(p["out"], jnp.einsum("ne,enf->nf", dispatch, ye), b["y"])

  def per_expert(p, b):
    xe = jnp.einsum("ne,nd->end", dispatch, b["x"])
    ys = [jnp.tanh(xe[e] @ p["experts"][e]) for e in range(L)]
    return _head(p["out"], jnp.einsum("ne,enf->nf", dispatch, jnp.stack(ys)), b["y"])

  found = _assert_same(
    (moe, {"experts": kernels, "out": out}),
    (per_expert, {"experts": [l["w"] for l in layers], "out": out}),
    lambda g: {"experts": list(g["experts"]), "out": g["out"]},
  )
  assert next(s for s in found if s.stack_size).factor_shapes == ((L, D, D), (L, D, D))


def test_closed_over_scan_parameter_stays_shared(x64):
  """An RNN's kernel closed over by the scan: one layer with T uses, not a stack."""
  layers, out = _layers()
  w = layers[0]["w"]

  def rnn(p, b):
    h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ p["w"] + x), None), b["x"], jnp.zeros((L, N, D)))
    return _head(p["out"], h, b["y"])

  found = kfac_jax.Registration(rnn, {"w": w, "out": out}, _batch(), check_loss=False).layers
  rec = next(s for s in found if s.param_paths == ("w",))
  assert rec.num_uses == L and rec.stack_size == 0 and rec.approx == "kron_indep"


def test_stack_in_scale_by_kfac(x64):
  """A stacked layer through the optax transform: jitted updates are finite and the stacked
  factors keep their leading axis."""
  layers, out = _layers()

  def scanned(p, b):
    h, _ = jax.lax.scan(lambda h, l: (_block(l["w"], l["b"], h), None), b["x"], p["stack"])
    return _head(p["out"], h, b["y"])

  params = {"stack": _stack(layers), "out": out}
  batch = _batch()
  tx = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(
      scanned, params, batch, estimation_mode="exact", check_loss=False
    ),
    damping=1e-2,
  )

  @jax.jit
  def step(params):
    return tx.update(jax.grad(scanned)(params, batch), tx.init(params), params, batch=batch)

  updates, state = step(params)
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(updates))
  shapes = {x.shape for x in jax.tree_util.tree_leaves(state) if getattr(x, "ndim", 0) == 3}
  assert (L, D + 1, D + 1) in shapes and (L, D, D) in shapes


def _program_size(loss_fn, params, batch):
  """(scans, dot_generals) in the jaxpr of one `value_and_grad` with statistics."""
  text = str(
    jax.make_jaxpr(lambda p: kfac_jax.value_and_grad(loss_fn)(p, batch, jax.random.key(0)))(params)
  )
  return text.count(" scan["), text.count("dot_general")


@pytest.mark.parametrize("kind", ["stacked", "rnn"])
def test_scan_stays_a_scan(kind):
  """The tapped evaluation re-emits a scan over parameters: the program does not grow with the
  number of scanned layers or time steps."""
  batch = _batch()

  def build(n):
    if kind == "stacked":
      layers, out = _layers(n=n)

      def loss_fn(p, b):
        h, _ = jax.lax.scan(lambda h, l: (_block(l["w"], l["b"], h), None), b["x"], p["stack"])
        return _head(p["out"], h, b["y"])

      return loss_fn, {"stack": _stack(layers), "out": out}
    layers, out = _layers()

    def loss_fn(p, b):
      h, _ = jax.lax.scan(
        lambda h, x: (jnp.tanh(h @ p["w"] + x), None), b["x"], jnp.ones((n, N, D))
      )
      return _head(p["out"], h, b["y"])

    return loss_fn, {"w": layers[0]["w"], "out": out}

  small, large = _program_size(*build(2), batch), _program_size(*build(16), batch)
  assert small[0] >= 1 and small == large
