"""`kfac_jax._migrate`: every spelling of DeepMind's kfac-jax 0.0.8 that a script moved over
carries (the Optimizer's keywords, init's and step's calling convention, the module attributes
FermiNet and DeepQMC read) gives an error naming the spelling here and the migration page; any
other bad call keeps Python's own error; the translations the table gives hold."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _migrate
from tests import _models

PAGE = "docs/from_kfac_jax.rst"

# kfac-jax 0.0.8's `Optimizer.__init__` keywords (its signature, in order).
KFAC_JAX_OPTIMIZER = (
  "value_and_grad_func l2_reg regularized_parameters_path_exclusions value_func_has_aux "
  "value_func_has_state value_func_has_rng value_func_for_estimator use_adaptive_learning_rate "
  "learning_rate_schedule use_adaptive_momentum momentum_schedule use_adaptive_damping "
  "damping_schedule initial_damping use_initial_damping_calibration min_damping max_damping "
  "include_damping_in_quad_change damping_adaptation_interval damping_adaptation_decay "
  "damping_lower_threshold damping_upper_threshold always_use_exact_qmodel_for_damping_adjustment "
  "precon_damping_mult precon_damping_schedule use_step_rejection reject_damping_increase_factor "
  "norm_constraint num_burnin_steps estimation_mode custom_estimator_ctor curvature_ema "
  "curvature_update_period inverse_update_period use_exact_inverses batch_process_func "
  "register_only_generic patterns_to_skip use_automatic_registration auto_register_kwargs "
  "layer_tag_to_block_ctor multi_device debug invalid_metric_value batch_size_extractor "
  "pmap_axis_name forbid_setting_attributes_after_finalize modifiable_attribute_exceptions "
  "include_norms_in_stats include_per_param_norms_in_stats include_registered_loss_in_stats "
  "distributed_precon_apply distributed_inverses num_estimator_samples "
  "should_vmap_estimator_samples norm_to_scale_identity_weight_per_block precon_power "
  "exact_quad_model_matrix_type"
).split()
# Keywords with the same name and meaning here.
SAME = {"l2_reg", "use_adaptive_damping", "norm_constraint"}
# kfac-jax 0.0.8's `kfac_jax.__all__` (and `TwoKroneckerFactored` of earlier versions).
KFAC_JAX_ALL = (
  "TwoKroneckerFactored utils patches_second_moment layers_and_loss_tags loss_functions "
  "tag_graph_matcher tracer "
  "curvature_blocks curvature_estimator optimizer patches_moments patches_moments_explicit "
  "LossTag LayerTag register_generic register_dense register_conv2d register_scale_and_shift "
  "auto_register_tags ProcessedJaxpr loss_tags_vjp loss_tags_jvp loss_tags_hvp layer_tags_vjp "
  "LossFunction NegativeLogProbLoss DistributionNegativeLogProbLoss "
  "NormalMeanNegativeLogProbLoss NormalMeanVarianceNegativeLogProbLoss "
  "MultiBernoulliNegativeLogProbLoss CategoricalLogitsNegativeLogProbLoss "
  "OneHotCategoricalLogitsNegativeLogProbLoss register_sigmoid_cross_entropy_loss "
  "register_multi_bernoulli_predictive_distribution register_softmax_cross_entropy_loss "
  "register_categorical_predictive_distribution register_squared_error_loss "
  "register_normal_predictive_distribution CurvatureBlock ScaledIdentity Diagonal Full "
  "KroneckerFactored NaiveDiagonal NaiveFull NaiveTNT DenseDiagonal DenseFull "
  "DenseTwoKroneckerFactored RepeatedDenseKroneckerFactored DenseTNT Conv2DDiagonal Conv2DFull "
  "Conv2DTwoKroneckerFactored Conv2DTNT ScaleAndShiftDiagonal ScaleAndShiftFull "
  "set_max_parallel_elements get_max_parallel_elements "
  "set_default_eigen_decomposition_threshold get_default_eigen_decomposition_threshold "
  "CurvatureEstimator BlockDiagonalCurvature ExplicitExactCurvature ImplicitExactCurvature "
  "set_default_tag_to_block_ctor get_default_tag_to_block_ctor Optimizer"
).split()
# Module attributes FermiNet and DeepQMC read (besides those in `__all__`).
DOWNSTREAM = ("utils", "LayerVjpData", "OptaxPreconditioner", "HAIKU_BIASES")


def _problem():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=4, classes=3)
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _lines(message: str) -> dict[str, str]:
  """`name → line` of a migration error's bullet list."""
  out = {}
  for line in message.splitlines():
    if line.startswith("  - `"):
      out[line[len("  - `") :].split("`")[0]] = line
  return out


def test_every_optimizer_keyword_of_kfac_jax_is_named_with_its_spelling():
  """All of kfac-jax's constructor keywords at once: one error, one line per keyword (its
  spelling from the table), the page named; the three kept names are no lines."""
  loss_fn, _, batch = _problem()
  given = {n: None for n in KFAC_JAX_OPTIMIZER if n not in SAME}
  with pytest.raises(TypeError) as info:
    kfac_jax.Optimizer(loss_fn, batch, **given)
  message = str(info.value)
  assert PAGE in message and "unexpected keyword argument" in message
  lines = _lines(message)
  assert set(lines) == set(given), set(given) ^ set(lines)
  for name, line in lines.items():
    assert _migrate.MOVED[name].spelling in line, (name, line)
  assert set(KFAC_JAX_OPTIMIZER) - set(given) == SAME
  for name in SAME:  # The same name and meaning here (l2_reg: tests/test_optimizer.py).
    assert name in inspect.signature(kfac_jax.Optimizer).parameters


def test_a_call_in_kfac_jax_form_is_read_as_kfac_jax_binds_it():
  """FermiNet's constructor call: `value_and_grad_func` positional, kfac-jax keywords; the
  message names the calling convention, and the estimation mode with its name here."""
  loss_fn, params, batch = _problem()
  with pytest.raises(TypeError) as info:
    kfac_jax.Optimizer(
      jax.value_and_grad(loss_fn, has_aux=True),
      l2_reg=0.0,
      norm_constraint=1e-3,
      value_func_has_aux=True,
      value_func_has_rng=True,
      curvature_ema=0.95,
      inverse_update_period=1,
      min_damping=1e-4,
      num_burnin_steps=0,
      estimation_mode="fisher_exact",
      multi_device=True,
      pmap_axis_name="qmc_pmap_axis",
    )
  message = str(info.value)
  assert "the calling convention → Optimizer(loss_fn, example_batch, *, ...)" in message
  lines = _lines(message)
  assert "estimation_mode='exact'" in lines["estimation_mode"]
  assert "ema_decay=" in lines["curvature_ema"] and "axis_name=" in lines["pmap_axis_name"]
  assert "Config(burn_in_steps=...)" in lines["num_burnin_steps"]
  assert "l2_reg" not in lines and "norm_constraint" not in lines
  with pytest.raises(ValueError, match="kfac-jax's name; here it is 'exact_GGN'"):
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="ggn_exact")


def test_init_and_step_in_kfac_jax_convention():
  """`init(params, rng, batch)` and `step(params, state, rng, batch=..., global_step_int=...)`
  give the convention here before anything runs (the loss is not called)."""
  loss_fn, params, batch = _problem()
  calls = []

  def counted(p, b):
    calls.append(1)
    return loss_fn(p, b)

  opt = kfac_jax.Optimizer(counted, batch)
  key = jax.random.key(0)
  with pytest.raises(TypeError) as info:
    opt.init(params, key, batch)
  message = str(info.value)
  assert "the calling convention → init(params)" in message and PAGE in message
  assert set(_lines(message)) == {"rng", "batch"}
  state = opt.init(params)
  n = len(calls)
  step_here = _migrate.MOVED["Optimizer.step"].spelling
  for kw in ({}, {"global_step_int": 3}, {"func_state": None}):
    with pytest.raises(TypeError) as info:
      opt.step(params, state, key, batch=batch, **kw)
    assert f"the calling convention → {step_here}" in str(info.value)
    assert set(_lines(str(info.value))) == set(kw)
  with pytest.raises(TypeError, match=r"`data_iterator` → batch=next\(data_iterator\)"):
    opt.step(params, state, key, data_iterator=iter([batch]))
  with pytest.raises(TypeError, match="the calling convention"):  # Also through jax.jit.
    jax.jit(opt.step)(params, state, key, batch=batch)
  assert len(calls) == n


@pytest.mark.parametrize("key", [jax.random.key(0), jax.random.PRNGKey(0)], ids=["typed", "raw"])
def test_the_old_argument_order_is_named_before_the_loss_runs(key):
  """`step(params, state, rng, batch)` binds (batch ↔ rng): the engine's check names the order
  instead of the loss failing on a key (jitted or not)."""
  loss_fn, params, batch = _problem()
  calls = []

  def counted(p, b):
    calls.append(1)
    return loss_fn(p, b)

  opt = kfac_jax.Optimizer(counted, batch)
  state = opt.init(params)
  n = len(calls)
  for step in (opt.step, jax.jit(opt.step)):
    with pytest.raises(TypeError, match="`batch` is a key: the arguments are swapped") as info:
      step(params, state, key, batch)
    assert _migrate.MOVED["Optimizer.step"].spelling in str(info.value)
  assert len(calls) == n
  with pytest.raises(TypeError, match=r"`rng` must be a jax.random key, got 0 \(int\)"):
    opt.step(params, state, batch, 0)


def test_other_binding_errors_and_errors_inside_are_untouched():
  """A misspelt keyword of our own, or a TypeError raised inside the callable, is not read as
  kfac-jax's."""
  loss_fn, _, batch = _problem()
  with pytest.raises(TypeError) as info:
    kfac_jax.Optimizer(loss_fn, batch, dampnig=0.1)
  assert str(info.value) == "Optimizer.__init__() got an unexpected keyword argument 'dampnig'"
  with pytest.raises(TypeError) as info:
    kfac_jax.kfac(loss_fn, batch, 0.1, 0.2)
  assert PAGE not in str(info.value)
  with pytest.raises(TypeError, match="`damping` must be") as info:
    kfac_jax.Optimizer(loss_fn, batch, damping="0.1")
  assert PAGE not in str(info.value)
  # The wrappers keep the signatures (help() shows them; tests/suites/test_signatures.py).
  assert "self" not in inspect.signature(kfac_jax.Optimizer).parameters
  assert list(inspect.signature(kfac_jax.Optimizer.step).parameters)[:5] == [
    "self",
    "params",
    "state",
    "batch",
    "rng",
  ]


def test_the_transforms_name_what_they_take_instead():
  loss_fn, _, batch = _problem()
  with pytest.raises(TypeError) as info:
    kfac_jax.kfac(loss_fn, batch, 0.1, norm_constraint=1e-3, curvature_ema=0.9, l2_reg=1e-4)
  lines = _lines(str(info.value))
  assert f"max_norm=√C / α = {np.sqrt(1e-3) / 0.1:.6g}" in lines["norm_constraint"]
  assert "ema_decay=" in lines["curvature_ema"] and "damping=λ + η" in lines["l2_reg"]
  with pytest.raises(TypeError, match=r"kfac_jax.kfac\(..., max_norm=√C / α\)"):
    kfac_jax.scale_by_kfac(loss_fn, batch, norm_constraint=1e-3)


def test_kfac_max_norm_is_the_optimizers_norm_constraint(x64):
  """The table's translation: `kfac(learning_rate=α, max_norm=√C / α)` takes the step of
  `Optimizer(learning_rate=α, norm_constraint=C)` (fixed momentum 0 and damping, exact
  statistics, clipping active)."""
  loss_fn, params, batch = _problem()
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
  batch = {"x": batch["x"].astype(jnp.float64), "y": batch["y"]}
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  alpha, c, lam = 0.5, 1e-4, 1e-2
  opt = kfac_jax.Optimizer(
    registration=reg,
    learning_rate=alpha,
    momentum=0.0,
    damping=lam,
    use_adaptive_damping=False,
    norm_constraint=c,
    inverse_every=1,
  )
  new_params, _, info = jax.jit(opt.step)(params, jax.jit(opt.init)(params), batch, None)
  assert float(info["learning_rate"]) < alpha  # The constraint is active.
  tx = kfac_jax.kfac(
    registration=reg,
    learning_rate=alpha,
    momentum=None,
    max_norm=np.sqrt(c) / alpha,
    damping=lam,
    curvature_every=1,
    inverse_every=1,
  )

  @jax.jit
  def update(params):
    loss, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch)
    updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
    return jax.tree_util.tree_map(jnp.add, params, updates)

  for a, b in zip(jax.tree_util.tree_leaves(update(params)), jax.tree_util.tree_leaves(new_params)):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)


def test_kfac_jax_module_attributes_name_their_spelling():
  """Every name of kfac-jax's `__all__` (and those FermiNet and DeepQMC read) is here or in the
  table; the table's are not here (an AttributeError, `hasattr` False)."""
  for name in (*KFAC_JAX_ALL, *DOWNSTREAM):
    if name in kfac_jax.__dict__:
      continue
    moved = _migrate.MOVED.get(f"kfac_jax.{name}")
    assert moved is not None, name
    with pytest.raises(AttributeError) as info:
      getattr(kfac_jax, name)
    assert moved.spelling in str(info.value) and PAGE in str(info.value), name
    assert not hasattr(kfac_jax, name)
  for key in _migrate.MOVED:
    if key.startswith("kfac_jax."):
      assert key[len("kfac_jax.") :] not in kfac_jax.__dict__, key
  with pytest.raises(AttributeError, match=r"^module 'kfac_jax' has no attribute 'nothing'$"):
    kfac_jax.nothing  # noqa: B018
