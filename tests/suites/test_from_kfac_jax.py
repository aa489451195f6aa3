"""The migration page (`docs/from_kfac_jax.rst`) holds on the installed JAX: its code runs, every
row of its two tables is executed (a renamed option: kfac-jax's spelling is refused naming the
one here, which works; a pmap helper: the JAX line does what kfac-jax's helper does), and its
adapter runs a FermiNet-style training loop unchanged.
"""

import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _migrate
from tests import _models
from tests.suites.test_docs import DOCS, run_page

PAGE = "docs/from_kfac_jax.rst"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
  """The page's code, run in order in one namespace (as test_docs runs the other pages)."""
  with pytest.MonkeyPatch.context() as mp:
    return run_page("from_kfac_jax", tmp_path_factory.mktemp("page"), mp)


def _table(title):
  """[(left cell, right cell)] of the simple table in section `title`."""
  with open(os.path.join(DOCS, "from_kfac_jax.rst"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  start = lines.index(title)
  borders = [i for i in range(start, len(lines)) if re.fullmatch(r"=+ +=+", lines[i])][:3]
  col = lines[borders[0]].index(" =") + 1
  return [(l[:col].strip(), l[col:].strip()) for l in lines[borders[1] + 1 : borders[2]]]


def _code(cell):
  """The first inline literal of a cell."""
  return re.match(r"``(.+?)``", cell).group(1)


def test_the_calling_convention_block(page):
  """The page's Optimizer, with an L2 term in the loss and `l2_reg`, took a finite step whose
  gradient is the loss's (kfac-jax's meaning of `l2_reg`)."""
  info, state = page["info"], page["state"]
  assert np.isfinite(float(info["loss"])) and int(state.step) == 1 and not bool(info["skipped"])
  (cache,) = {k: v for k, v in state.curvature.cache.items() if k.endswith("w1")}.values()
  np.testing.assert_allclose(cache.damping, 1e-3 + page["eta"], rtol=1e-6)


# -- the pmap helpers ------------------------------------------------------------------------


def _on_devices(a, slices):
  """`a` has slice i of `slices` on local device i."""
  shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
  assert [s.device for s in shards] == jax.local_devices()
  for s, want in zip(shards, slices):
    np.testing.assert_array_equal(np.asarray(s.data)[0], np.asarray(want))


def _same_keys(a, b):
  return np.array_equal(jax.random.key_data(a), jax.random.key_data(b))


def _check_replicate(run, n):
  x = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(2)}
  out = run(x=x)
  for a, leaf in zip(jax.tree.leaves(out), jax.tree.leaves(x)):
    assert a.shape == (n, *leaf.shape)
    _on_devices(a, [leaf] * n)
  # What pmap does with it: each device sees one copy.
  sums = jax.pmap(lambda t: jax.lax.psum(t["b"].sum(), "d"), axis_name="d")(out)
  np.testing.assert_allclose(np.asarray(sums), 2.0 * n)


def _check_broadcast(run, n):
  x = jnp.arange(n * 3.0).reshape(n, 3)  # One slice per device, as kfac-jax's helper expects.
  out = run(x=x)
  assert out.shape == x.shape
  _on_devices(out, list(x))


def _check_different_keys(run, n):
  keys = run(key=jax.random.key(0))
  assert keys.shape == (n,)
  data = np.asarray(jax.random.key_data(keys))
  assert len({row.tobytes() for row in data}) == n  # n different keys
  _on_devices(jax.random.key_data(keys), list(data))


def _check_p_split(run, n):
  keys = jax.random.split(jax.random.key(1), n)
  out = run(keys=keys)
  assert isinstance(out, tuple) and len(out) == 2  # `a, b = p_split(keys)` unpacks a pair
  for i in range(n):
    first, second = jax.random.split(keys[i])
    assert _same_keys(out[0][i], first) and _same_keys(out[1][i], second)


def _check_p_split_num(run, n):
  keys = jax.random.split(jax.random.key(2), n)
  out = run(keys=keys, k=3)
  assert isinstance(out, tuple) and len(out) == 3
  for i in range(n):
    for j, want in enumerate(jax.random.split(keys[i], 3)):
      assert _same_keys(out[j][i], want)


def _inside_pmap(run, n, reduce):
  xs = jnp.arange(n * 2.0).reshape(n, 2)
  out = jax.pmap(lambda x: run(x=x, axis_name="i", f=jax.lax.pmean), axis_name="i")(xs)
  np.testing.assert_allclose(np.asarray(out), np.broadcast_to(reduce(np.asarray(xs)), xs.shape))


def _check_pmean(run, n):
  _inside_pmap(run, n, lambda a: a.mean(0))


def _check_psum(run, n):
  _inside_pmap(run, n, lambda a: a.sum(0))


def _check_wrap(run, n):  # `f` is jax.lax.pmean here.
  _inside_pmap(run, n, lambda a: a.mean(0))


def _check_first(run, n):
  x = {"a": jnp.arange(n * 2.0).reshape(n, 2)}
  np.testing.assert_array_equal(run(x=x)["a"], x["a"][0])


def _check_mean(run, n):
  x = {"a": jnp.arange(n * 2.0).reshape(n, 2)}
  np.testing.assert_allclose(run(x=x)["a"], np.asarray(x["a"]).mean(0))


HELPERS = {
  "``replicate_all_local_devices(x)``": _check_replicate,
  "``broadcast_all_local_devices(x)``": _check_broadcast,
  "``make_different_rng_key_on_all_devices(key)``": _check_different_keys,
  "``p_split(keys)``": _check_p_split,
  "``p_split_num(keys, k)``": _check_p_split_num,
  "``pmean_if_pmap(x, axis_name)``": _check_pmean,
  "``psum_if_pmap(x, axis_name)``": _check_psum,
  "``wrap_if_pmap(f)(x, axis_name)``": _check_wrap,
  "``get_first(x)``": _check_first,
  "``get_mean(x)``": _check_mean,
}


def test_every_pmap_helper_row_is_checked():
  assert [left for left, _ in _table("The pmap helpers")] == list(HELPERS)


@pytest.mark.parametrize("row", list(HELPERS))
def test_pmap_helper_row(page, row):
  """The row's JAX line, evaluated as written with the page's `n` and `per_device`, does what
  kfac-jax's helper does (on the suite's 8 CPU devices)."""
  (code,) = [_code(right) for left, right in _table("The pmap helpers") if left == row]
  assert page["n"] == jax.local_device_count() > 1

  def run(**inputs):
    return eval(code, {"jax": jax, "jnp": jnp, **page, **inputs})  # noqa: S307

  HELPERS[row](run, page["n"])


# -- the renamed options ---------------------------------------------------------------------


def _problem():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=4, classes=3)
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _refused(name, value=None, front=None, **kw):
  """The line of the migration error for kfac-jax's keyword `name` given to `front`."""
  loss_fn, _, batch = _problem()
  with pytest.raises(TypeError) as info:
    (front or kfac_jax.Optimizer)(loss_fn, batch, **kw, **{name: value})
  assert PAGE in str(info.value)
  return next(l for l in str(info.value).splitlines() if l.startswith(f"  - `{name}`"))


def _step(opt, params, batch, steps=1, **per_step):
  state = jax.jit(opt.init)(params)
  step = jax.jit(opt.step)
  infos = []
  for t in range(steps):
    params, state, info = step(params, state, batch, jax.random.key(t), **per_step)
    infos.append(info)
  return params, state, infos


def _row_value_and_grad():
  assert "loss_fn" in _refused("value_and_grad_func", jax.value_and_grad(_problem()[0]))
  loss_fn, params, batch = _problem()
  _, _, (info,) = _step(kfac_jax.Optimizer(loss_fn, batch), params, batch)
  assert np.isfinite(float(info["loss"]))


def _row_has_aux():
  assert "has_aux=True" in _refused("value_func_has_aux", True)
  loss_fn, params, batch = _problem()
  reg = kfac_jax.Registration(lambda p, b: (loss_fn(p, b), {"n": 1.0}), params, batch, has_aux=True)
  _, _, (info,) = _step(kfac_jax.Optimizer(registration=reg), params, batch)
  assert float(info["aux"]["n"]) == 1.0


def _row_rng_state():
  assert "the key in `batch`" in _refused("value_func_has_rng", True)
  assert "the state in `batch`" in _refused("value_func_has_state", True)
  loss_fn, params, data = _problem()

  def keyed(p, batch):  # kfac-jax's `loss(params, rng, data)` with the key in the batch.
    key, data = batch
    noise = 1e-3 * jax.random.normal(key, data["x"].shape)
    return loss_fn(p, {**data, "x": data["x"] + noise})

  batch = (jax.random.key(5), data)
  _, _, (info,) = _step(kfac_jax.Optimizer(keyed, batch), params, batch)
  assert np.isfinite(float(info["loss"]))


def _row_for_estimator():
  assert "curvature_fn=" in _refused("value_func_for_estimator", lambda p, b: 0.0)
  loss_fn, params, batch = _problem()
  reg = kfac_jax.Registration(loss_fn, params, batch, curvature_fn=loss_fn)
  assert len(reg.layers) == 2


def _mode_row(*pairs):
  def check():
    loss_fn, params, batch = _problem()
    for old, new in pairs:
      assert f"estimation_mode={new!r}" in _refused("estimation_mode", old)
      with pytest.raises(ValueError, match=f"here it is {new!r}"):
        kfac_jax.Registration(loss_fn, params, batch, estimation_mode=old)
      assert (
        kfac_jax.Registration(loss_fn, params, batch, estimation_mode=new).estimation_mode == new
      )

  return check


def _row_samples():
  assert "num_samples=" in _refused("num_estimator_samples", 2)
  loss_fn, params, batch = _problem()
  assert kfac_jax.Registration(loss_fn, params, batch, num_samples=2).num_samples == 2


def _row_learning_rate():
  assert "learning_rate=" in _refused("learning_rate_schedule", lambda t: 0.1)
  loss_fn, params, batch = _problem()
  opt = kfac_jax.Optimizer(loss_fn, batch, learning_rate=lambda t: 0.1 / (1.0 + t), momentum=0.0)
  _, _, infos = _step(opt, params, batch, steps=2)
  np.testing.assert_allclose([float(i["learning_rate"]) for i in infos], [0.1, 0.05], rtol=1e-6)


def _row_momentum():
  assert "momentum=" in _refused("momentum_schedule", lambda t: 0.5)
  loss_fn, params, batch = _problem()
  opt = kfac_jax.Optimizer(loss_fn, batch, learning_rate=0.1, momentum=lambda t: 0.5 + 0 * t)
  _, _, (info,) = _step(opt, params, batch)
  assert float(info["momentum"]) == 0.5


def _row_damping():
  assert "damping=" in _refused("initial_damping", 1.0)
  assert "damping=" in _refused("damping_schedule", lambda t: 1.0)
  loss_fn, params, batch = _problem()
  opt = kfac_jax.Optimizer(
    loss_fn, batch, damping=lambda t: 0.5 + 0 * t, use_adaptive_damping=False, momentum=0.0
  )
  _, _, (info,) = _step(opt, params, batch)
  np.testing.assert_allclose(float(info["damping"]), 0.5)


def _adaptive_row(name, ours):
  def check():
    assert f"{ours}=None" in _refused(name, True)
    loss_fn, params, batch = _problem()
    _, _, infos = _step(kfac_jax.Optimizer(loss_fn, batch), params, batch, steps=2)
    assert float(infos[1][ours]) not in (0.0, 1.0)  # From the quadratic model.

  return check


def _renamed_row(name, ours, value):
  def check():
    assert f"{ours}=" in _refused(name, value)
    loss_fn, _, batch = _problem()
    assert getattr(kfac_jax.Optimizer(loss_fn, batch, **{ours: value}), ours) == value

  return check


def _row_burn_in():
  assert "Config(burn_in_steps=...)" in _refused("num_burnin_steps", 2)
  loss_fn, params, batch = _problem()
  opt = kfac_jax.Optimizer(loss_fn, batch, config=kfac_jax.Config(burn_in_steps=2))
  _, _, infos = _step(opt, params, batch, steps=3)
  assert [float(i["update_norm"]) == 0.0 for i in infos] == [True, True, False]


def _row_min_max_damping():
  assert "Config(min_damping=...)" in _refused("min_damping", 1e-4)
  assert "Config(max_damping=...)" in _refused("max_damping", 1.0)
  loss_fn, _, batch = _problem()
  config = kfac_jax.Config(min_damping=1e-4, max_damping=1.0)
  assert kfac_jax.Optimizer(loss_fn, batch, config=config).config.max_damping == 1.0


def _row_pmap():
  assert "jax.pmap(opt.step" in _refused("multi_device", True)
  assert "axis_name=" in _refused("pmap_axis_name", "batch")
  loss_fn, params, batch = _problem()
  devices = jax.local_devices()[:2]
  opt = kfac_jax.Optimizer(loss_fn, batch, axis_name="batch")
  halves = jax.tree.map(lambda a: a.reshape(2, -1, *a.shape[1:]), batch)
  both = jax.tree.map(lambda a: jnp.stack([a, a]), params)
  state = jax.pmap(opt.init, axis_name="batch", devices=devices)(both)
  keys = jax.random.split(jax.random.key(0), 2)
  new, _, info = jax.pmap(opt.step, axis_name="batch", devices=devices)(both, state, halves, keys)
  np.testing.assert_array_equal(new["layer0"]["w"][0], new["layer0"]["w"][1])
  assert np.isfinite(np.asarray(info["loss"])).all()


def _row_l2_reg():
  assert "l2_reg" in inspect.signature(kfac_jax.Optimizer).parameters
  assert "damping=λ + η" in _refused("l2_reg", 1e-3, front=kfac_jax.kfac)
  # Its meaning is tested in tests/test_optimizer.py (ridge regression in one step).


def _row_norm_constraint():
  loss_fn, _, batch = _problem()
  assert kfac_jax.Optimizer(loss_fn, batch, learning_rate=0.1, norm_constraint=1e-3)
  line = _refused("norm_constraint", 1e-3, front=kfac_jax.kfac, learning_rate=0.1)
  assert f"max_norm=√C / α = {np.sqrt(1e-3) / 0.1:.6g}" in line
  # The translation's step is tested in tests/test_migrate.py.


def _row_graph_patterns():
  assert "LayerConfig" in _refused("auto_register_kwargs", {"graph_patterns": ()})
  loss_fn, params, batch = _problem()
  layers = kfac_jax.LayerConfig(overrides={"layer0/*": "diagonal"})
  reg = kfac_jax.Registration(loss_fn, params, batch, layers=layers)
  assert [spec.approx for spec in reg.layers] == ["diagonal", "kron"]


def _row_blocks():
  assert "LayerConfig(blocks=...)" in _refused("layer_tag_to_block_ctor", {})
  assert "blocks" in {f.name for f in kfac_jax.LayerConfig.__dataclass_fields__.values()}
  # A block of one's own through `LayerConfig(blocks=)` runs on docs/layers.rst (test_docs).


def _row_init():
  loss_fn, params, batch = _problem()
  opt = kfac_jax.Optimizer(loss_fn, batch)
  with pytest.raises(TypeError, match=r"the calling convention → init\(params\)"):
    opt.init(params, jax.random.key(0), batch)
  assert isinstance(jax.jit(opt.init)(params), kfac_jax.OptimizerState)


def _row_global_step():
  assert "state.step" in _migrate.MOVED["Optimizer.step.global_step_int"].spelling
  loss_fn, params, batch = _problem()
  opt = kfac_jax.Optimizer(loss_fn, batch)
  state = jax.jit(opt.init)(params)
  with pytest.raises(TypeError, match="`global_step_int` → nothing"):
    opt.step(params, state, batch, jax.random.key(0), global_step_int=0)
  _, state, _ = _step(opt, params, batch, steps=2)
  assert int(state.step) == 2


def _row_state_class():
  assert not hasattr(kfac_jax.Optimizer, "State")
  loss_fn, params, batch = _problem()
  state = jax.jit(kfac_jax.Optimizer(loss_fn, batch).init)(params)
  assert isinstance(state, kfac_jax.OptimizerState)


def _row_stats():
  loss_fn, params, batch = _problem()
  _, _, (info,) = _step(kfac_jax.Optimizer(loss_fn, batch), params, batch)
  assert {"loss", "rho"} <= set(info)


RENAMED = {
  "``value_and_grad_func=jax.value_and_grad(loss_fn)``": _row_value_and_grad,
  "``value_func_has_aux=True``": _row_has_aux,
  "``value_func_has_rng`` / ``value_func_has_state``": _row_rng_state,
  "``value_func_for_estimator``": _row_for_estimator,
  '``estimation_mode="fisher_gradients"``': _mode_row(("fisher_gradients", "gradients")),
  '``estimation_mode="fisher_empirical"``': _mode_row(("fisher_empirical", "empirical")),
  '``estimation_mode="fisher_exact"`` / ``"ggn_exact"``': _mode_row(
    ("fisher_exact", "exact"), ("ggn_exact", "exact_GGN")
  ),
  '``estimation_mode="ggn_curvature_prop"``': _mode_row(
    ("ggn_curvature_prop", "curvature_prop_GGN")
  ),
  "``num_estimator_samples``": _row_samples,
  "``learning_rate_schedule``": _row_learning_rate,
  "``momentum_schedule``": _row_momentum,
  "``initial_damping`` / ``damping_schedule``": _row_damping,
  "``use_adaptive_learning_rate=True``": _adaptive_row(
    "use_adaptive_learning_rate", "learning_rate"
  ),
  "``use_adaptive_momentum=True``": _adaptive_row("use_adaptive_momentum", "momentum"),
  "``curvature_ema``": _renamed_row("curvature_ema", "ema_decay", 0.9),
  "``inverse_update_period``": _renamed_row("inverse_update_period", "inverse_every", 2),
  "``curvature_update_period``": _renamed_row("curvature_update_period", "curvature_every", 2),
  "``num_burnin_steps``": _row_burn_in,
  "``min_damping``, ``max_damping``": _row_min_max_damping,
  "``multi_device=True``, ``pmap_axis_name``": _row_pmap,
  "``l2_reg``": _row_l2_reg,
  "``norm_constraint=C`` of the Optimizer": _row_norm_constraint,
  "``auto_register_kwargs=dict(graph_patterns=...)``": _row_graph_patterns,
  "``layer_tag_to_block_ctor``, a custom block class": _row_blocks,
  "``optimizer.init(params, key, batch)``": _row_init,
  "``global_step_int=t``": _row_global_step,
  "``kfac_jax.Optimizer.State``": _row_state_class,
  '``stats["loss"]``, ``stats["rho"]``': _row_stats,
}


def test_every_renamed_option_row_is_checked():
  assert [left for left, _ in _table("Renamed options")] == list(RENAMED)


@pytest.mark.parametrize("row", list(RENAMED))
def test_renamed_option_row(row):
  """kfac-jax's spelling is refused naming the one here (from the table in
  `kfac_jax._migrate`), and the one here does what the row says."""
  RENAMED[row]()


# -- the adapter on a FermiNet-style loop ----------------------------------------------------
#
# A hydrogen atom: log ψ(r) = −|r| c(|r|), c a small tanh network (exact at c ≡ 1, E = −1/2),
# walkers moved by Metropolis steps on |ψ|², the energy a custom_jvp whose rule gives the VMC
# gradient and registers the curvature of log ψ (FermiNet's `total_energy`, written anew).

AXIS = "qmc_pmap_axis"


def _init_wavefunction(key):
  k1, k2 = jax.random.split(key)
  return {
    "hidden": {"w": jax.random.normal(k1, (1, 8)), "b": jnp.zeros(8)},
    "out": {"w": 0.1 * jax.random.normal(k2, (8, 1)), "b": jnp.full(1, 0.6)},
  }


def _log_psi(params, r):  # r: [B, 3] -> [B]
  radius = jnp.linalg.norm(r, axis=-1, keepdims=True)
  h = jnp.tanh(radius @ params["hidden"]["w"] + params["hidden"]["b"])
  c = h @ params["out"]["w"] + params["out"]["b"]
  return -(radius * c)[:, 0]


def _local_energy(params, r):
  def one(x):
    f = lambda y: _log_psi(params, y[None])[0]  # noqa: E731
    grad = jax.grad(f)(x)
    lap = jnp.trace(jax.hessian(f)(x))
    return -0.5 * (lap + grad @ grad) - 1.0 / jnp.linalg.norm(x)

  return jax.vmap(one)(r)


@jax.custom_jvp
def total_energy(params, key, data):
  del key  # FermiNet's loss takes one (for its pseudopotential quadrature).
  e_l = _local_energy(params, data)
  loss = jax.lax.pmean(jnp.mean(e_l), AXIS)
  variance = jax.lax.pmean(jnp.mean((e_l - loss) ** 2), AXIS)
  return loss, {"variance": variance, "local_energy": e_l}


@total_energy.defjvp
def _total_energy_jvp(primals, tangents):
  params, key, data = primals
  loss, aux = total_energy(params, key, data)
  psi, dpsi = jax.jvp(lambda p: _log_psi(p, data), (params,), (tangents[0],))
  kfac_jax.register_normal_predictive_distribution(psi[:, None])
  grad = 2.0 * jnp.mean((aux["local_energy"] - loss) * dpsi)
  return (loss, aux), (grad, jax.tree.map(jnp.zeros_like, aux))


def _mcmc_step(params, data, key, width=0.5, steps=3):
  def one(carry, k):
    x, logp = carry
    k1, k2 = jax.random.split(k)
    y = x + width * jax.random.normal(k1, x.shape)
    logp_y = 2.0 * _log_psi(params, y)
    accept = jnp.log(jax.random.uniform(k2, logp.shape)) < logp_y - logp
    return (jnp.where(accept[:, None], y, x), jnp.where(accept, logp_y, logp)), None

  (data, _), _ = jax.lax.scan(
    one, (data, 2.0 * _log_psi(params, data)), jax.random.split(key, steps)
  )
  return data


def test_the_adapter_runs_a_ferminet_style_loop(page):
  """FermiNet's loop, names changed to the adapter and the page's helpers: replicated params,
  per-device walkers and keys, `init(params, subkeys, data)`, `step(params=..., state=...,
  rng=..., batch=..., momentum=..., damping=...)` with per-device scalars, `stats["loss"]` and
  `stats["aux"]`. The energy falls from above −0.45 to the exact −1/2 (within the noise of 512
  walkers)."""
  n, per_device = page["n"], page["per_device"]
  replicate = lambda x: jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * n), x), per_device)  # noqa: E731
  broadcast = lambda x: jax.device_put(x, per_device)  # noqa: E731
  p_split = jax.pmap(lambda k: tuple(jax.random.split(k)))

  key = jax.random.key(0)
  params = replicate(_init_wavefunction(key))
  walkers = 0.5 * jax.random.normal(jax.random.key(1), (n, 64, 3))
  data = broadcast(walkers)
  sharded_key = broadcast(jax.random.split(jax.random.fold_in(key, jax.process_index()), n))

  optimizer = page["KfacJaxOptimizer"](
    jax.value_and_grad(total_energy, argnums=0, has_aux=True),
    l2_reg=0.0,
    norm_constraint=1e-2,
    value_func_has_aux=True,
    value_func_has_rng=True,
    learning_rate_schedule=lambda t: 0.5 / (1.0 + t / 100.0),
    curvature_ema=0.95,
    inverse_update_period=1,
    min_damping=1e-4,
    num_burnin_steps=0,
    register_only_generic=False,
    estimation_mode="fisher_exact",
    multi_device=True,
    pmap_axis_name=AXIS,
    auto_register_kwargs=dict(graph_patterns=()),
  )
  sharded_key, subkeys = p_split(sharded_key)
  state = optimizer.init(params, subkeys, data)
  assert [s.kind for s in optimizer.optimizer.estimator.registration.layers] == ["dense"] * 2

  mcmc = jax.pmap(_mcmc_step)
  shared_mom = replicate(jnp.zeros([]))
  shared_damping = replicate(jnp.asarray(1e-3))
  for _ in range(5):  # Equilibrate the walkers.
    sharded_key, subkeys = p_split(sharded_key)
    data = mcmc(params, data, subkeys)
  energies, variances = [], []
  for _ in range(60):
    sharded_key, subkeys = p_split(sharded_key)
    mcmc_keys, loss_keys = p_split(subkeys)
    data = mcmc(params, data, mcmc_keys)
    params, state, stats = optimizer.step(
      params=params,
      state=state,
      rng=loss_keys,
      batch=data,
      momentum=shared_mom,
      damping=shared_damping,
    )
    energies.append(float(stats["loss"][0]))
    variances.append(float(stats["aux"]["variance"][0]))
  assert len(optimizer.steps) == 1  # One compiled step.
  assert int(state.step[0]) == 60 and not np.asarray(stats["skipped"]).any()
  np.testing.assert_array_equal(params["out"]["b"][0], params["out"]["b"][-1])  # In sync.
  assert np.isfinite(variances).all()
  assert np.mean(energies[:5]) > -0.45 and abs(np.mean(energies[-10:]) + 0.5) < 0.02, energies
