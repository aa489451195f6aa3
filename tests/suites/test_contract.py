"""The optax contract, run over every transformation the library offers.

`scale_by_kfac` (chained with a learning rate), `kfac`, `Optimizer(...).as_optax()` and
`kernel_ngd` must each:
jit their init and update; compile once (the second and later steps, inverse refreshes
included, reuse the program); work inside `optax.chain` next to another transform and inside
`optax.inject_hyperparams` (the two factories); plug into `nnx.Optimizer`; keep bfloat16
params bfloat16; continue identically after a `state_to_bytes` / `state_from_bytes` round trip;
converge on a least-squares problem; and take a step that donates params and state (an
eager `init`, whose leaves must be distinct buffers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kfac_jax
from tests import _models

KINDS = ["scale_by_kfac", "kfac", "optimizer", "kernel_ngd"]


def _least_squares(n=64, din=5, dout=2, dtype=jnp.float32):
  rng = _models.np_rng(0)  # On the host: each eager op would compile a program of its own.
  x = rng.standard_normal((n, din)).astype(dtype)
  w_true = rng.standard_normal((din, dout)).astype(dtype)
  y = (x @ w_true + 1.0 + 0.1 * rng.standard_normal((n, dout))).astype(dtype)
  params = jax.device_put(
    {"dense": {"w": np.zeros((din, dout), dtype), "b": np.zeros(dout, dtype)}}
  )

  def loss_fn(params, batch):
    pred = batch["x"] @ params["dense"]["w"] + params["dense"]["b"]
    kfac_jax.register_squared_error_loss(pred, batch["y"])
    return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1))

  xa = np.concatenate([np.asarray(x, np.float64), np.ones((n, 1))], axis=1)
  coef = np.linalg.lstsq(xa, np.asarray(y, np.float64), rcond=None)[0]
  best = float(np.mean(np.sum((xa @ coef - np.asarray(y, np.float64)) ** 2, axis=-1)))
  return loss_fn, params, jax.device_put({"x": x, "y": y}), best


def _make(kind, loss_fn, batch, **kw):
  """The transformation, and the extra arguments its update takes."""
  if kind == "scale_by_kfac":
    lr = kw.pop("learning_rate", 0.5)
    tx = optax.chain(
      kfac_jax.scale_by_kfac(
        loss_fn, batch, damping=1e-3, inverse_every=3, **_models.with_config(kw)
      ),
      optax.scale_by_learning_rate(lr),
    )
  elif kind == "kfac":
    # Clipping off: these tests check the optax contract, and the exact least-squares
    # convergence in 25 steps needs unclipped steps (clipping at the default max_norm slows it).
    # Unclipped, λ = 1e-3 steps from statistics up to 4 updates old diverge on the nnx MLP:
    # statistics every update.
    kw = {
      "learning_rate": 0.5,
      "momentum": 0.3,
      "max_norm": None,
      "curvature_every": 1,
      **kw,
    }
    tx = kfac_jax.kfac(loss_fn, batch, damping=1e-3, inverse_every=3, **_models.with_config(kw))
  elif kind == "kernel_ngd":
    # λ = 1e-2: the exact Gauss-Newton step of the nnx classifier overshoots at 1e-3.
    kw = {"learning_rate": 0.5, **kw}
    tx = kfac_jax.kernel_ngd(loss_fn, batch, damping=1e-2, **_models.with_config(kw))
  else:
    tx = kfac_jax.Optimizer(loss_fn, batch, inverse_every=3, **_models.with_config(kw)).as_optax()
  return tx


def _extra(kind, loss_fn, params, batch, rng):
  """`(grads, loss, kwargs for update)`: one forward pass for the transforms; the Optimizer
  computes everything from the batch."""
  if kind in ("optimizer", "kernel_ngd"):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return grads, loss, {"batch": batch, "rng": rng}
  loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
  return grads, loss, {"curvature_stats": stats}


def _step_fn(kind, loss_fn, tx, traces=None):
  """The jitted train step; appends to `traces` each time JAX traces (compiles) it."""

  @jax.jit
  def step(params, state, batch, rng):
    if traces is not None:
      traces.append(1)
    grads, loss, kw = _extra(kind, loss_fn, params, batch, rng)
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state, loss, updates

  return step


def _assert_trees_equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", KINDS)
def test_jit_compiles_once_and_converges_on_least_squares(kind):
  loss_fn, params, batch, best = _least_squares()
  tx = _make(kind, loss_fn, batch)
  init_traces, traces = [], []
  init = jax.jit(lambda p: (init_traces.append(1), tx.init(p))[1])
  state = init(params)
  step = _step_fn(kind, loss_fn, tx, traces)
  losses = []
  for i in range(25):
    params, state, loss, _ = step(params, state, batch, jax.random.key(i))
    losses.append(float(loss))
  # Steps 2..25, across inverse refreshes (every 3), reuse the first step's program.
  assert len(traces) == 1 and len(init_traces) == 1
  final = float(jax.jit(loss_fn)(params, batch))  # Eagerly, each op compiles its own.
  assert final - best < 1e-2 * (losses[0] - best), (kind, losses[0], final, best)


@pytest.mark.parametrize("kind", KINDS)
def test_step_donating_params_and_state(kind):
  loss_fn, params, batch, _ = _least_squares()
  tx = _make(kind, loss_fn, batch)
  state = tx.init(params)  # eagerly: the arrays as a training loop would donate them
  leaves = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
  assert len({id(x) for x in leaves}) == len(leaves)

  def step(params, state, batch, rng):
    grads, loss, kw = _extra(kind, loss_fn, params, batch, rng)
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  first = None
  for i in range(4):
    old = params
    params, state, loss = step(params, state, batch, jax.random.key(i))
    first = float(loss) if first is None else first
  assert jax.tree_util.tree_leaves(old)[0].is_deleted()  # the buffers were donated
  assert float(jax.jit(loss_fn)(params, batch)) < first


@pytest.mark.parametrize("kind", KINDS)
def test_inside_optax_chain(kind):
  """Chained after a (here inactive) gradient clip and before a 0.5 scale: exactly half of
  the bare transformation's update, with the extra arguments forwarded through the chain."""
  loss_fn, params, batch, _ = _least_squares()
  bare = _make(kind, loss_fn, batch)
  chained = optax.chain(
    optax.clip_by_global_norm(1e6), _make(kind, loss_fn, batch), optax.scale(0.5)
  )
  # Jitted: eagerly, each op of the init compiles its own.
  s_bare, s_chain = jax.jit(lambda p: (bare.init(p), chained.init(p)))(params)
  traces = []
  step_bare, step_chain = _step_fn(kind, loss_fn, bare), _step_fn(kind, loss_fn, chained, traces)
  p_bare, apply_updates = params, jax.jit(optax.apply_updates)
  for i in range(3):
    rng = jax.random.key(i)
    _, s_bare, _, u_bare = step_bare(p_bare, s_bare, batch, rng)
    _, s_chain, _, u_chain = step_chain(p_bare, s_chain, batch, rng)
    for a, b in zip(jax.tree_util.tree_leaves(u_chain), jax.tree_util.tree_leaves(u_bare)):
      np.testing.assert_allclose(a, 0.5 * b, rtol=1e-5, atol=1e-7)
    p_bare = apply_updates(p_bare, u_bare)
  assert len(traces) == 1


@pytest.mark.parametrize("kind", ["scale_by_kfac", "kfac", "kernel_ngd"])
def test_inside_inject_hyperparams(kind):
  """Injected hyperparameters change the next update without a recompile: the learning rate
  scales it exactly; a larger damping makes it smaller."""
  loss_fn, params, batch, _ = _least_squares()
  static = ("loss_fn", "example_batch")
  if kind == "kfac":
    tx = optax.inject_hyperparams(kfac_jax.kfac, static_args=static)(
      loss_fn=loss_fn,
      example_batch=batch,
      learning_rate=0.1,
      damping=1e-3,
      momentum=None,
      max_norm=None,
    )  # α then scales the update exactly.
  elif kind == "kernel_ngd":
    tx = optax.inject_hyperparams(kfac_jax.kernel_ngd, static_args=static)(
      loss_fn=loss_fn, example_batch=batch, learning_rate=0.1, damping=1e-3
    )
  else:
    tx = optax.chain(
      optax.inject_hyperparams(kfac_jax.scale_by_kfac, static_args=static)(
        loss_fn=loss_fn, example_batch=batch, damping=1e-3
      ),
      optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=0.1),
    )
  state = jax.jit(tx.init)(params)  # Eagerly, each op compiles its own.
  traces = []
  step = _step_fn(kind, loss_fn, tx, traces)

  def with_hp(state, name, value):
    if kind in ("kfac", "kernel_ngd"):
      hp = state.hyperparams
      return state._replace(hyperparams={**hp, name: jnp.asarray(value, hp[name].dtype)})
    k = 1 if name == "learning_rate" else 0
    hp = state[k].hyperparams
    new = state[k]._replace(hyperparams={**hp, name: jnp.asarray(value, hp[name].dtype)})
    return tuple(new if j == k else s for j, s in enumerate(state))

  rng = jax.random.key(0)
  _, _, _, u1 = step(params, state, batch, rng)
  _, _, _, u3 = step(params, with_hp(state, "learning_rate", 0.3), batch, rng)
  for a, b in zip(jax.tree_util.tree_leaves(u3), jax.tree_util.tree_leaves(u1)):
    np.testing.assert_allclose(a, 3.0 * b, rtol=1e-5, atol=1e-8)
  _, _, _, ud = step(params, with_hp(state, "damping", 10.0), batch, rng)
  assert float(optax.tree.norm(ud)) < 0.5 * float(optax.tree.norm(u1))
  assert len(traces) == 1


def _nnx_loss(graphdef):
  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


@pytest.mark.parametrize("kind", KINDS)
def test_in_nnx_optimizer(kind):
  """`nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads, **kw)` forwards the extra
  arguments (flax 0.12: `update(self, model, grads, /, **kwargs)`)."""
  model = _models.NnxMLP(4, 8, 3, nnx.Rngs(0))
  graphdef, _ = nnx.split(model)
  batch = _models.classification_batch(jax.random.key(1), n=32)
  loss_fn = _nnx_loss(graphdef)
  tx = _make(kind, loss_fn, batch, **({} if kind == "optimizer" else {"learning_rate": 0.3}))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, rng):
    params = nnx.state(model, nnx.Param)
    grads, loss, kw = _extra(kind, loss_fn, params, batch, rng)
    optimizer.update(model, grads, **kw)
    return loss

  losses = [float(step(model, optimizer, batch, jax.random.key(i))) for i in range(12)]
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_params_keep_their_dtype(kind):
  params = jax.jit(lambda t: _models.to_dtype(t, jnp.bfloat16))(  # One program for the casts.
    _models.jnp_mlp_init(jax.random.key(0), (4, 8, 3))
  )
  batch = _models.classification_batch(jax.random.key(1), n=32, dtype=jnp.bfloat16)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  tx = _make(kind, loss_fn, batch, **({} if kind == "optimizer" else {"learning_rate": 0.1}))
  state = jax.jit(tx.init)(params)  # Eagerly, each op compiles its own.
  step = _step_fn(kind, loss_fn, tx)
  for i in range(3):
    params, state, loss, updates = step(params, state, batch, jax.random.key(i))
    assert np.isfinite(float(loss))
  assert {x.dtype for x in jax.tree_util.tree_leaves((params, updates))} == {
    jnp.dtype(jnp.bfloat16)
  }
  if kind == "kernel_ngd":  # No statistics: SPRING's previous direction keeps the params' dtype.
    return
  curv = jax.tree_util.tree_leaves(
    [
      s.curvature.factors
      for s in jax.tree_util.tree_leaves(state, is_leaf=lambda s: hasattr(s, "curvature"))
      if hasattr(s, "curvature")
    ]
  )
  assert curv and {x.dtype for x in curv} == {jnp.dtype(jnp.float32)}  # Statistics stay f32.


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_round_trip_continues_identically(kind):
  loss_fn, params, batch, _ = _least_squares()
  tx = _make(kind, loss_fn, batch)
  traces = []
  step = _step_fn(kind, loss_fn, tx, traces)
  init = jax.jit(tx.init)  # Eagerly, each op compiles its own.
  state = init(params)
  for i in range(2):
    params, state, _, _ = step(params, state, batch, jax.random.key(i))
  data = kfac_jax.state_to_bytes(state)
  restored = kfac_jax.state_from_bytes(init(params), data)
  _assert_trees_equal(restored, state)
  runs = []
  for s in (state, restored):
    p = params
    for i in range(2, 6):  # Crosses the inverse refresh at update 3.
      p, s, _, _ = step(p, s, batch, jax.random.key(i))
    runs.append((p, s))
  _assert_trees_equal(runs[0], runs[1])
  # The restored leaves are numpy arrays: JAX keeps a second dispatch-cache entry for them,
  # but traces (and compiles) the step only once.
  assert len(traces) == 1


def _shared_problem():
  """A 3-layer tanh MLP; `labels` gives its first layer to Adam and the rest to K-FAC (the
  optax idiom for an optimizer on a share of the parameters: optax.multi_transform)."""
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 6, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=4, classes=3)
  labels = {
    k: jax.tree.map(lambda _, k=k: "adam" if k == "layer0" else "kfac", v)
    for k, v in params.items()
  }
  return loss_fn, params, batch, labels


def _share_factory(kind, reg):
  if kind == "kfac":  # Unclipped: the clipping norm is over the transform's own leaves.
    return kfac_jax.kfac(
      registration=reg, learning_rate=0.3, max_norm=None, damping=1e-2, inverse_every=2
    )
  return optax.chain(
    kfac_jax.scale_by_kfac(registration=reg, damping=1e-2, inverse_every=2),
    optax.scale_by_learning_rate(0.3),
  )


@pytest.mark.parametrize("kind", ["scale_by_kfac", "kfac"])
def test_a_share_of_the_parameters_under_multi_transform(kind):
  """Handed a share of the parameters (optax.MaskedNode leaves), the transform keeps only that
  share's blocks in its state, and its updates are exactly those the transform over every
  parameter gives the share's leaves (the blocks are independent): over 5 updates, inverse
  refreshes included, beside Adam on the rest."""
  loss_fn, params, batch, labels = _shared_problem()
  # `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it
  # would only compile another program (the `kfac` has a learning rate and no norm constraint,
  # so nothing reads the loss factor).
  reg = kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
  tx = optax.multi_transform({"kfac": _share_factory(kind, reg), "adam": optax.adam(1e-2)}, labels)
  whole, adam = _share_factory(kind, reg), optax.adam(1e-2)
  vg = kfac_jax.value_and_grad(registration=reg)

  @jax.jit
  def step(p, s, rng):
    _, g, stats = vg(p, batch, rng)
    u, s = tx.update(g, s, p, curvature_stats=stats)
    return optax.apply_updates(p, u), s, u

  @jax.jit
  def reference(p, s_whole, s_adam, rng):
    _, g, stats = vg(p, batch, rng)
    u_whole, s_whole = whole.update(g, s_whole, p, curvature_stats=stats)
    u_adam, s_adam = adam.update(g, s_adam, p)
    u = {k: u_adam[k] if k == "layer0" else u_whole[k] for k in p}
    return optax.apply_updates(p, u), s_whole, s_adam, u

  # Jitted: eagerly, each op of the inits compiles its own.
  state, s_whole, s_adam = jax.jit(lambda p: (tx.init(p), whole.init(p), adam.init(p)))(params)
  inner = state.inner_states["kfac"].inner_state
  curv = (inner.preconditioner if kind == "kfac" else inner[0]).curvature
  assert sorted(curv.factors) == ["layer1", "layer2"]  # No block for Adam's layer.
  p, p_ref = params, params
  for i in range(5):
    p, state, u = step(p, state, jax.random.key(i))
    p_ref, s_whole, s_adam, u_ref = reference(p_ref, s_whole, s_adam, jax.random.key(i))
    for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(u_ref)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32, two programs.
  loss = jax.jit(loss_fn)  # Eagerly, each op compiles its own.
  assert float(loss(p, batch)) < float(loss(params, batch))


def test_a_share_of_the_parameters_is_refused_with_what_to_do():
  """A share without a registration (the model cannot be traced on part of the params), a
  layer split between two labels, `batch=` with a share, and the `Optimizer`'s optax form
  (it steps the whole model) each raise, naming the fix."""
  loss_fn, params, batch, labels = _shared_problem()
  reg = kfac_jax.Registration(loss_fn, params, batch)
  adam = optax.adam(1e-2)
  no_reg = optax.multi_transform(
    {"kfac": kfac_jax.kfac(loss_fn, batch, learning_rate=0.3), "adam": adam}, labels
  )
  with pytest.raises(ValueError, match=r"kfac: `params` has optax.MaskedNode.*registration=reg"):
    no_reg.init(params)
  split = {k: {"w": "kfac", "b": "adam"} for k in params}
  tx = optax.multi_transform(
    {"kfac": kfac_jax.kfac(registration=reg, learning_rate=0.3), "adam": adam}, split
  )
  with pytest.raises(
    ValueError, match=r"layer `layer0` has `layer0/w` in this .* `layer0/b` outside"
  ):
    tx.init(params)
  tx = optax.multi_transform(
    {"kfac": kfac_jax.kfac(registration=reg, learning_rate=0.3), "adam": adam}, labels
  )
  state = tx.init(params)
  with pytest.raises(
    ValueError, match=r"cannot trace the model on `batch=`: pass `curvature_stats=`"
  ):
    tx.update(params, state, params, batch=batch, rng=jax.random.key(0))
  opt = optax.multi_transform(
    {"kfac": kfac_jax.Optimizer(registration=reg).as_optax(), "adam": adam}, labels
  )
  with pytest.raises(ValueError, match=r"Optimizer.as_optax\(\): .* steps the whole model"):
    opt.init(params)


def test_inside_optax_multisteps():
  """`optax.MultiSteps(kfac, k)` (gradient accumulation): every k-th call makes the update
  `kfac` makes from the k micro-batches' mean gradient, with the statistics of the k-th
  micro-batch; the calls between return zeros and leave the K-FAC state as it was."""
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 6, 3))
  k = 3
  batches = [
    _models.classification_batch(jax.random.key(10 + i), n=16, din=4, classes=3)
    for i in range(2 * k)
  ]

  def make():
    return kfac_jax.kfac(
      loss_fn, batches[0], learning_rate=0.3, damping=1e-2, inverse_every=2, curvature_every=1
    )

  ms, ref = optax.MultiSteps(make(), every_k_schedule=k), make()
  vg = kfac_jax.value_and_grad(loss_fn)

  @jax.jit
  def step(p, s, b, rng):
    _, g, stats = vg(p, b, rng)
    u, s = ms.update(g, s, p, curvature_stats=stats)
    return optax.apply_updates(p, u), s, u

  s, t = jax.jit(lambda p: (ms.init(p), ref.init(p)))(params)  # Eagerly, each op compiles its own.
  p, q = params, params
  ref_vg = jax.jit(vg)

  @jax.jit
  def ref_update(grads, t, q, stats):
    mean = jax.tree.map(lambda *x: sum(x) / k, *grads)
    return ref.update(mean, t, q, curvature_stats=stats)

  for period in range(2):
    grads = []
    for m in range(k):
      i = period * k + m
      _, g, stats = ref_vg(q, batches[i], jax.random.key(i))
      grads.append(g)
      p, s, u = step(p, s, batches[i], jax.random.key(i))
      if m < k - 1:
        assert all(not np.any(x) for x in jax.tree_util.tree_leaves(u))
    u_ref, t = ref_update(grads, t, q, stats)
    q = jax.jit(optax.apply_updates)(q, u_ref)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(s.inner_opt_state.preconditioner.count) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_optax_tree_map_params_maps_the_parameter_copies(kind):
  """`optax.tree_map_params` (what sharding helpers use) calls `init` with a placeholder tree
  to find the state's copies of the parameters: the momentum (`kfac`) and the velocity
  (`Optimizer`) are mapped, the curvature is left as it is."""
  loss_fn, params, batch, _ = _least_squares()
  tx = _make(kind, loss_fn, batch)
  state = jax.jit(tx.init)(params)  # Eagerly, each op compiles its own.
  step = _step_fn(kind, loss_fn, tx)
  _, state, _, _ = step(params, state, batch, jax.random.key(0))
  mapped = jax.jit(lambda s: optax.tree_map_params(tx, lambda p: p + 1.0, s))(state)
  assert jax.tree_util.tree_structure(mapped) == jax.tree_util.tree_structure(state)
  changed = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(mapped), jax.tree_util.tree_leaves(state))
  ]
  n_params = len(jax.tree_util.tree_leaves(params))
  assert sum(changed) == (0 if kind == "scale_by_kfac" else n_params), kind
