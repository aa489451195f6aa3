"""Malformed uses, table-driven: each raises an error that names the culprit and hints at the fix.

Every case builds its inputs fresh (the gradient and statistics of `_problem()`, computed once,
in fresh containers) and calls one public entry point; the expected exception type
and a regular expression over its message are listed beside it. Cases on a transform also check
that the state passed in is left as it was.
"""

# `check_loss=False` where the registration only builds an estimator or a state: the loss audit
# is tested in tests/test_audit.py and the zoo; here it would only compile another program. The
# registrations that are the bad input (`_scan`) and the bare fronts keep it.

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models


def _problem():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


@functools.cache
def _cached_grads_and_stats():
  loss_fn, params, batch = _problem()
  # One program, once: run eagerly, each op would compile its own.
  _, grads, stats = jax.jit(kfac_jax.value_and_grad(loss_fn))(params, batch, jax.random.key(0))
  return grads, stats


def _grads_and_stats():
  """`_problem()`'s gradient (fresh containers: a test may edit them) and statistics."""
  grads, stats = _cached_grads_and_stats()
  return jax.tree_util.tree_map(lambda x: x, grads), stats


def _dense_loss(tag):
  """A one-layer model whose loss calls `tag(logits, params, batch)` to register itself."""

  def loss_fn(params, batch):
    logits = batch["x"] @ params["w"]
    tag(logits, params, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


W = {"w": jnp.ones((4, 3))}


def _batch():
  return _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)


def _scan(loss_fn, params=W, batch=None, **kw):
  return lambda: (
    kfac_jax.Registration(loss_fn, params, _batch() if batch is None else batch, **kw).layers
  )


def _tx(**kw):
  def call():
    args, kwargs = _models.front_args(*_problem(), kw)
    return kfac_jax.scale_by_kfac(*args, **kwargs)

  return call


def _est(**kw):
  def call():
    settings = {k: v for k, v in kw.items() if k in _models.REGISTRATION_KNOBS}
    rest = _models.with_config({k: v for k, v in kw.items() if k not in settings})
    reg = kfac_jax.Registration(*_problem(), **{"check_loss": False, **settings})
    return kfac_jax.CurvatureEstimator(reg, **rest)

  return call


def _update(mutate, jit=False):
  """tx.update with the arguments `mutate(grads, params, batch)` returns (inside `jax.jit` with
  `jit`: the error must come at trace time, with the same message)."""

  def run():
    loss_fn, params, batch = _problem()
    tx = kfac_jax.scale_by_kfac(loss_fn, batch)
    state = jax.jit(tx.init)(params)  # Eagerly, each op compiles its own.
    before = jax.tree_util.tree_map(np.asarray, state)
    grads, _ = _grads_and_stats()
    args, kwargs = mutate(grads, params, batch)

    def update(s):
      return tx.update(*args[:1], s, *args[1:], **kwargs)

    try:
      (jax.jit(update) if jit else update)(state)
    finally:
      for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(b))

  run.mutate = mutate
  return run


def _multiply(vector_fn, exp=-1):
  def run():
    loss_fn, params, batch = _problem()
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
    )
    state = jax.jit(est.init)(params)  # Eagerly, each op compiles its own.
    est.multiply_matpower(state, vector_fn(params), exp)

  return run


def _no_tag(params, batch):
  return jnp.mean((batch["x"] @ params["w"]) ** 2)


def _sce(**kw):
  return _dense_loss(lambda z, p, b: kfac_jax.register_softmax_cross_entropy_loss(z, **kw))


def _vmapped_tag(params, batch):
  def one(x, y):
    z = x @ params["w"]
    kfac_jax.register_squared_error_loss(z, y)
    return jnp.sum((z - y) ** 2)

  return jnp.mean(jax.vmap(one)(batch["x"], jax.nn.one_hot(batch["y"], 3)))


def _non_scalar(params, batch):
  logits = batch["x"] @ params["w"]
  kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def _dense_tag(kw):
  def tag(z, p, b):
    kfac_jax.register_dense(z, b["x"], **kw(p, b))
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"])

  return _dense_loss(tag)


def _twice(params, batch):
  logits = batch["x"] @ params["w"]
  kfac_jax.register_generic(params["w"])
  kfac_jax.register_generic(params["w"])
  kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
  return jnp.mean(logits)


CASES = [
  # -- loss tags ---------------------------------------------------------------------------
  ("no loss tag", _scan(_no_tag), kfac_jax.RegistrationError, "no loss tag.*register_"),
  (
    "targets of the wrong shape",
    _scan(_sce(targets=jnp.zeros((8, 2), jnp.int32))),
    ValueError,
    "`targets` has shape \\(8, 2\\), expected",
  ),
  (
    "float class indices",
    _scan(_sce(targets=jnp.zeros((8,)))),
    TypeError,
    "class-index `targets` must be integers",
  ),
  (
    "weight that does not broadcast",
    _scan(_sce(weight=jnp.ones((5,)))),
    ValueError,
    "`weight` of shape \\(5,\\) does not broadcast",
  ),
  (
    "integer logits",
    lambda: kfac_jax.register_softmax_cross_entropy_loss(jnp.zeros((4, 3), jnp.int32)),
    TypeError,
    "prediction must be floating point",
  ),
  (
    "logits without a batch axis",
    lambda: kfac_jax.register_softmax_cross_entropy_loss(jnp.zeros((3,))),
    ValueError,
    "logits must have shape \\[batch, \\.\\.\\., num_classes\\]",
  ),
  (
    "scalar prediction",
    lambda: kfac_jax.register_squared_error_loss(jnp.zeros(())),
    ValueError,
    "needs a leading batch axis",
  ),
  (
    "non-positive variance",
    lambda: kfac_jax.register_normal_predictive_distribution(jnp.zeros((4, 2)), var=0.0),
    ValueError,
    "`var` must be a positive finite",
  ),
  (
    "a list as prediction",
    lambda: kfac_jax.register_squared_error_loss([1.0, 2.0]),
    TypeError,
    "`prediction` must be an array",
  ),
  (
    "loss tag inside vmap over the batch",
    _scan(_vmapped_tag),
    kfac_jax.RegistrationError,
    "inside jax.vmap.*outside the vmap",
  ),
  (
    "loss that is not a scalar",
    _scan(_non_scalar),
    kfac_jax.RegistrationError,
    "must return one scalar loss",
  ),
  # -- layer tags and parameters ------------------------------------------------------------
  (
    "integer parameter",
    _scan(_sce(targets=None), params={"w": jnp.ones((4, 3), jnp.int32)}),
    kfac_jax.RegistrationError,
    "parameter `w` has dtype int32.*floating-point",
  ),
  (
    "complex parameter",
    _scan(_sce(targets=None), params={"w": jnp.ones((4, 3), jnp.complex64)}),
    kfac_jax.RegistrationError,
    "parameter `w` has dtype complex64.*real parameters.*two real leaves",
  ),
  (
    "manual kernel that is not a parameter",
    _scan(_dense_tag(kw=lambda p, b: dict(kernel=jnp.ones((4, 3))))),
    kfac_jax.RegistrationError,
    "`kernel` is not a parameter leaf",
  ),
  (
    "bias of the wrong size",
    _scan(
      _dense_tag(kw=lambda p, b: dict(kernel=p["w"], bias=p["b"])),
      params={"w": jnp.ones((4, 3)), "b": jnp.ones((2,))},
    ),
    ValueError,
    "register_dense: `bias` has shape \\(2,\\), expected \\(3,\\)",
  ),
  (
    "unknown approximation for a dense layer",
    _scan(_dense_tag(kw=lambda p, b: dict(kernel=p["w"], approx="banana"))),
    kfac_jax.RegistrationError,
    "approximation 'banana' does not fit.*`?w`?",
  ),
  (
    "parameter registered twice",
    _scan(_twice),
    kfac_jax.RegistrationError,
    "same parameter appears twice|registered twice",
  ),
  (
    "uncovered parameter with strict=True",
    _scan(_sce(targets=None), params={"w": jnp.ones((4, 3)), "unused": jnp.ones(2)}, strict=True),
    kfac_jax.RegistrationError,
    "`unused`.*strict=True",
  ),
  # -- transform / estimator configuration -------------------------------------------------
  ("negative damping", _tx(damping=-1.0), ValueError, "`damping` must be a finite number >= 0"),
  ("NaN damping", _tx(damping=float("nan")), ValueError, "`damping` must be a finite number"),
  ("ema_decay of 1", _tx(ema_decay=1.0), ValueError, "`ema_decay` must be a number in \\[0, 1\\)"),
  ("NaN ema_decay", _tx(ema_decay=float("nan")), ValueError, "`ema_decay`"),
  (
    "zero inverse period",
    _tx(inverse_every=0),
    ValueError,
    "`inverse_every` must be a positive integer",
  ),
  ("fractional inverse period", _tx(inverse_every=2.5), ValueError, "`inverse_every`"),
  (
    "unknown estimation mode",
    _tx(estimation_mode="fisher"),
    ValueError,
    "unknown estimation_mode 'fisher'.*exact_GGN",
  ),
  (
    "unknown damping mode",
    _est(damping_mode="tikhonov"),
    ValueError,
    "unknown config.damping_mode 'tikhonov'",
  ),
  (
    "num_samples of zero",
    _est(num_samples=0),
    ValueError,
    "`num_samples` must be an int >= 1, got 0",
  ),
  (
    "num_samples as a JAX array",
    _tx(num_samples=jnp.asarray(2)),
    TypeError,
    "`num_samples` fixes array shapes",
  ),
  (
    "num_samples with the exact mode",
    _est(estimation_mode="exact", num_samples=3),
    ValueError,
    "num_samples does not apply",
  ),
  ("a zero matrix power", _est(exps=(0,)), ValueError, "`exps` must be non-zero"),
  ("axis_name that is not a string", _tx(axis_name=3), TypeError, "`axis_name` must be a string"),
  (
    "an optimizer as the line search",
    lambda: kfac_jax.kfac(_problem()[0], _batch(), linesearch=optax.adam(1e-3)),
    TypeError,
    "`linesearch` must be a line search.*learning_rate",
  ),
  ("unknown keyword argument", _tx(dampening=1.0), TypeError, "dampening"),
  (
    "a loss_fn that is not callable",
    lambda: kfac_jax.Registration("loss", W, _batch()),
    TypeError,
    "`loss_fn` must be callable",
  ),
  # -- calls ------------------------------------------------------------------------------
  (
    "update without params",
    _update(lambda g, p, b: ((g,), {})),
    ValueError,
    "`params` is required",
  ),
  (
    "update without statistics or batch",
    _update(lambda g, p, b: ((g, p), {})),
    ValueError,
    "pass `curvature_stats=`",
  ),
  (
    "params pytree changed after init",
    _update(
      lambda g, p, b: ((g, {**p, "extra": jnp.ones(2)}), dict(batch=b, rng=jax.random.key(0)))
    ),
    ValueError,
    "params pytree differs",
  ),
  (
    "params dtype changed after init",
    _update(
      lambda g, p, b: ((g, _models.to_dtype(p, jnp.float16)), dict(batch=b, rng=jax.random.key(0)))
    ),
    ValueError,
    "params pytree differs",
  ),
  (
    "updates of another dtype than the params",
    _update(
      lambda g, p, b: ((_models.to_dtype(g, jnp.float16), p), dict(batch=b, rng=jax.random.key(0)))
    ),
    ValueError,
    "`updates` leaf `layer0/b` has shape \\(5,\\) and dtype float16, but the params leaf has "
    "shape \\(5,\\) and dtype float32",
  ),
  (
    "sampled mode without rng",
    _update(lambda g, p, b: ((g, p), dict(batch=b))),
    ValueError,
    "pass `rng`",
  ),
  (
    "empirical mode without targets",
    lambda: kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        _sce(), W, _batch(), estimation_mode="empirical", check_loss=False
      )
    )(W, _batch()),
    ValueError,
    "empirical.*needs the data's targets",
  ),
  (
    "matrix power the estimator was not built for",
    _multiply(lambda p: p, exp=-0.5),
    ValueError,
    "matrix power -0.5 was not prepared",
  ),
  (
    "vector of another structure",
    _multiply(lambda p: {"layer0": p["layer0"]}),
    ValueError,
    "vector's pytree structure differs",
  ),
  (
    "vector leaf of another shape",
    _multiply(lambda p: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape + (1,)), p)),
    ValueError,
    "has shape .* expected",
  ),
]


JIT_CASES = [c for c in CASES if hasattr(c[1], "mutate")]


def test_case_names_are_unique():
  """pytest would silently suffix duplicate ids; a duplicate usually hides a copy-paste case."""
  names = [c[0] for c in CASES]
  assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("name,call,exc,match", JIT_CASES, ids=[c[0] for c in JIT_CASES])
def test_update_errors_are_raised_at_trace_time_under_jit(name, call, exc, match):
  """Users call tx.update inside their jitted step: the same clear error, not an XLA failure."""
  with pytest.raises(exc, match=match):
    _update(call.mutate, jit=True)()


@pytest.mark.parametrize("name,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, exc, match):
  with pytest.raises(exc, match=match):
    call()


# -- a state that is not this model's -----------------------------------------------------------


def _wide():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 7, 3))
  return _models.softmax_loss(_models.jnp_mlp_apply), params, _batch()


def _sharded_state(loss_fn, params, batch):
  """A sharded-storage state (one device's share, made under pmap over 1 device)."""
  tx = kfac_jax.scale_by_kfac(
    loss_fn, batch, axis_name="data", config=kfac_jax.Config(inverse_storage="sharded")
  )
  stacked = jax.pmap(tx.init, axis_name="data")(jax.tree_util.tree_map(lambda x: x[None], params))
  return jax.tree_util.tree_map(lambda x: x[0], stacked)


def _wrong_state(front: str, make_state):
  """`front`'s update on (params, batch) of `_problem()` with the state `make_state()` built."""

  def run():
    loss_fn, params, batch = _problem()
    grads, stats = _grads_and_stats()
    state = make_state()
    # Under `jax.jit`, as a training step runs it: the state check reads shapes, so the error is
    # the same at trace time; eagerly, each op run before it (a whole preconditioner step for
    # the rest of a chain's state) would compile its own.
    if front == "Optimizer":
      opt = kfac_jax.Optimizer(loss_fn, batch)
      jax.jit(lambda s: opt.step(params, s, batch, jax.random.key(0)))(state)
    elif front == "estimator":
      est = kfac_jax.CurvatureEstimator(
        kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
      )
      jax.jit(lambda s: est.update_inverses(s, 0.1))(state)
    else:
      tx = (kfac_jax.kfac if front == "kfac" else kfac_jax.scale_by_kfac)(loss_fn, batch)
      jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=stats))(state)

  return run


def _tx_state(make=kfac_jax.scale_by_kfac, problem=_wide, **kw):
  def build():
    loss_fn, params, batch = problem()
    return jax.jit(make(loss_fn, batch, **kw).init)(params)  # Eagerly, each op compiles its own.

  return build


def _diagonal_state():
  loss_fn, params, batch = _problem()
  layers = kfac_jax.LayerConfig(defaults={"dense": "diagonal"})
  reg = kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False)
  return jax.jit(kfac_jax.scale_by_kfac(registration=reg).init)(params)


WRONG_STATES = [
  # Another model's state with the same layer names and other widths.
  (
    "scale_by_kfac",
    _tx_state(),
    r"block `layer0` .*has \(7, 7\) float32, this model needs \(5, 5\)",
  ),
  ("kfac", _tx_state(kfac_jax.kfac), r"block `layer0` .*has \(7, 7\) .*needs \(5, 5\)"),
  (
    "Optimizer",
    lambda: jax.jit(kfac_jax.Optimizer(_wide()[0], _wide()[2]).init)(_wide()[1]),
    r"(?s)Optimizer: `state` is not a state of this model.*block `layer0`.*\(7, 7\)",
  ),
  (
    "estimator",
    lambda: jax.jit(
      kfac_jax.CurvatureEstimator(kfac_jax.Registration(*_wide(), check_loss=False)).init
    )(),
    r"(?s)`state` is not a state of this model.*block `layer0`.*\(7, 7\)",
  ),
  # Another LayerConfig: the blocks are of another kind.
  ("scale_by_kfac", _diagonal_state, r"block `layer0`: `factors/a` is missing from"),
  # A sharded state into a replicated front.
  ("scale_by_kfac", lambda: _sharded_state(*_problem()), r"it is sharded \(inverse_storage="),
  # A kfac state without momentum into a kfac with it.
  ("kfac", _tx_state(kfac_jax.kfac, _problem, momentum=None), r"built without momentum"),
]


@pytest.mark.parametrize(
  "front, make_state, match",
  WRONG_STATES,
  ids=["widths", "kfac-widths", "Optimizer", "estimator", "layers", "sharded", "momentum"],
)
def test_a_state_of_another_model_names_what_differs(front, make_state, match):
  with pytest.raises(ValueError, match=match):
    _wrong_state(front, make_state)()


@pytest.mark.parametrize("front", ["kfac", "Optimizer"])
def test_the_state_check_traces_init_once_per_params_signature(front, monkeypatch):
  """Every trace of an update (every call of an eager one) checks the state against the
  front's init as shapes: init is traced for it once per params signature (treedef, shapes,
  dtypes, shardings), and a state of another model (of other widths; without momentum) is
  still refused by the cached shapes."""
  loss_fn, params, batch = _problem()
  grads, stats = _grads_and_stats()
  inits = []

  def counted(init):
    return lambda *a, **k: (inits.append(1), init(*a, **k))[1]

  if front == "Optimizer":  # The whole state is checked; `init` makes it.
    monkeypatch.setattr(kfac_jax.Optimizer, "init", counted(kfac_jax.Optimizer.init))
    opt = kfac_jax.Optimizer(loss_fn, batch)
    state, other = opt.init(params), WRONG_STATES[2][1]()

    def update(s):
      return opt.step(params, s, batch, jax.random.key(0))

    match = WRONG_STATES[2][2]
  else:  # The rest of the chain's state is checked; its momentum's init is counted.
    trace = optax.trace

    def counted_trace(*a, **k):
      tx = trace(*a, **k)
      return optax.GradientTransformation(counted(tx.init), tx.update)

    monkeypatch.setattr(optax, "trace", counted_trace)
    tx = kfac_jax.kfac(loss_fn, batch)
    state, other = tx.init(params), _tx_state(kfac_jax.kfac, _problem, momentum=None)()

    def update(s):
      return tx.update(grads, s, params, curvature_stats=stats)

    match = "built without momentum"
  inits.clear()
  for _ in range(3):  # Three traces of the update (a new function each: no trace cache hit).
    jax.make_jaxpr(lambda s: update(s))(state)
  assert len(inits) == 1
  with pytest.raises(ValueError, match=match):
    jax.make_jaxpr(update)(other)
  assert len(inits) == 1


def test_an_unbound_axis_name_names_the_argument_and_the_wrapper():
  loss_fn, params, batch = _problem()
  grads, stats = _grads_and_stats()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, axis_name="data")
  state = jax.jit(kfac_jax.scale_by_kfac(loss_fn, batch).init)(params)  # Eagerly, each op compiles.
  match = r"`axis_name`='data' is not bound here.*jax.pmap\(\.\.\., axis_name='data'\)"
  with pytest.raises(ValueError, match="scale_by_kfac: " + match):
    jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=stats))(state)
  opt = kfac_jax.Optimizer(loss_fn, batch, axis_name="data")
  with pytest.raises(ValueError, match="Optimizer: " + match):
    opt.step(
      params, jax.jit(kfac_jax.Optimizer(loss_fn, batch).init)(params), batch, jax.random.key(0)
    )


def test_check_restored_state_reads_what_nnx_optimizer_holds():
  nnx = pytest.importorskip("flax.nnx")
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch)
  init = jax.jit(tx.init)  # Eagerly, each op compiles its own.
  # nnx.Optimizer keeps each leaf of the optax state in a variable (its `value`).
  held = jax.tree_util.tree_map(nnx.OptState, init(params))
  kfac_jax.check_restored_state(init(params), held)
  loss_w, params_w, batch_w = _wide()
  wide = jax.tree_util.tree_map(
    nnx.OptState, jax.jit(kfac_jax.scale_by_kfac(loss_w, batch_w).init)(params_w)
  )
  with pytest.raises(ValueError, match=r"block `layer0` .*checkpoint has \(7, 7\)"):
    kfac_jax.check_restored_state(init(params), wide)


@functools.cache
def _rng_calls():
  """Per front, a call that omits `rng` in the default (sampled) estimation mode."""
  loss_fn, params, batch = _problem()
  grads, _ = _grads_and_stats()
  reg = kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
  tx = kfac_jax.scale_by_kfac(registration=reg)
  tx_state = jax.jit(tx.init)(params)
  est = kfac_jax.CurvatureEstimator(reg)
  est_state = jax.jit(est.init)(params)
  opt = kfac_jax.Optimizer(registration=reg)
  opt_state = jax.jit(opt.init)(params)
  return {
    "scale_by_kfac": lambda: tx.update(grads, tx_state, params, batch=batch),
    "estimator": lambda: est.update_curvature(est_state, params, batch, None, ema_decay=0.5),
    "value_and_grad": lambda: kfac_jax.value_and_grad(registration=reg)(params, batch),
    "Optimizer": lambda: opt.step(params, opt_state, batch),
  }


@pytest.mark.parametrize("front", ["scale_by_kfac", "estimator", "value_and_grad", "Optimizer"])
def test_a_missing_rng_is_refused_before_any_pass_runs(front, monkeypatch):
  """A sampled estimation mode without `rng` is refused before the front traces the loss or
  checks the gradient (eagerly, those compile a program per operation first)."""
  call = _rng_calls()[front]

  def ran(*args, **kwargs):
    raise AssertionError("a pass ran before `rng` was checked")

  for name in ("scan_batch", "linearise"):
    monkeypatch.setattr(kfac_jax.Registration, name, ran)
  monkeypatch.setattr(kfac_jax._engine, "inputs_ok", ran)
  with pytest.raises(ValueError, match="estimation_mode='gradients'.*pass `rng`"):
    call()


def test_a_kfac_state_without_momentum_is_refused_before_any_pass_runs(monkeypatch):
  """The rest of the chain's state is checked before the preconditioner's step runs (eagerly,
  its every operation would compile first); a state of another model still names its block."""
  loss_fn, params, batch = _problem()
  grads, stats = _grads_and_stats()
  tx = kfac_jax.kfac(loss_fn, batch)
  other = _tx_state(kfac_jax.kfac, _problem, momentum=None)()

  inputs_ok = kfac_jax._engine.inputs_ok

  def traced_only(reporter, inputs, *args):  # Traced (to find the block's error) but not run.
    if not isinstance(jax.tree_util.tree_leaves(inputs)[0], jax.core.Tracer):
      raise AssertionError("a pass ran before the state was checked")
    return inputs_ok(reporter, inputs, *args)

  monkeypatch.setattr(kfac_jax._engine, "inputs_ok", traced_only)
  with pytest.raises(ValueError, match="built without momentum"):
    tx.update(grads, other, params, curvature_stats=stats)
