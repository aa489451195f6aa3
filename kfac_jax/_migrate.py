"""DeepMind kfac-jax's spellings, for those who move a script over: one table (`MOVED`: a
kfac-jax name → its spelling here and why), read in one place.

`translated` wraps a public callable. It does nothing unless Python cannot bind a call's
arguments (an unexpected keyword, a surplus positional argument); then the names kfac-jax's
callable of that role would have bound are looked up, and a TypeError gives each one's spelling
here. Any other binding error is Python's own, unchanged. `missing_attribute` does the same for
the package's attributes (`kfac_jax.utils`). The library's own former spellings are not in the
table: they are plain TypeErrors and lines in docs/changes.rst.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

PAGE = "docs/from_kfac_jax.rst"


class Moved(NamedTuple):
  """A kfac-jax name's spelling here, why, and (optionally) a function of the call's arguments
  (kfac-jax's names → values) giving the spelling with those values (None: not computable)."""

  spelling: str
  reason: str
  computed: Callable[[dict[str, Any]], str | None] | None = None


def _estimation_mode(args: dict[str, Any]) -> str | None:
  mode = args.get("estimation_mode")
  here = ESTIMATION_MODES.get(mode) if isinstance(mode, str) else None
  return None if here is None else _REG.format(f"estimation_mode={here!r}")


def _max_norm(args: dict[str, Any]) -> str | None:
  c, alpha = args.get("norm_constraint"), args.get("learning_rate")
  if not (isinstance(c, (int, float)) and isinstance(alpha, (int, float)) and c > 0 < alpha):
    return None
  return f"max_norm=√C / α = {math.sqrt(c) / alpha:.6g}"


# kfac-jax's estimation modes → the names here (`Registration(estimation_mode=)`).
ESTIMATION_MODES = {
  "fisher_gradients": "gradients",
  "fisher_empirical": "empirical",
  "fisher_curvature_prop": "curvature_prop",
  "ggn_curvature_prop": "curvature_prop_GGN",
  "fisher_exact": "exact",
  "ggn_exact": "exact_GGN",
}

_REG = "kfac_jax.Registration(loss_fn, params, batch, {}) passed as `registration=`"
_SCAN = "a setting of the scan: the registration's, shared by every front"
_CONFIG = "a rare knob: `Config` holds them for every front"
_NONE = "no equivalent"
_BLOCKS = (
  "kfac_jax.Block (kfac_jax.blocks) for a block of your own, given by "
  "`LayerConfig(blocks={pattern: cls})`; a layer's approximation is a string "
  '(`LayerConfig(overrides={"params/Dense_0/*": "diagonal"})`)'
)
_INTERNAL = "the tracer's internals are not public: kfac_jax.Registration(...) scans the loss"

# The table. A key "front.name" is that front's own entry (a keyword of `Optimizer.step`, kfac's
# `norm_constraint`); a bare name is a keyword of kfac-jax's `Optimizer` as every front here
# reads it; "kfac_jax.name" is a module attribute; "Optimizer.init" / "Optimizer.step" the
# calling convention.
MOVED: dict[str, Moved] = {
  # -- kfac_jax.Optimizer(...) -------------------------------------------------------------------
  "value_and_grad_func": Moved(
    "loss_fn (the loss itself, `loss_fn(params, batch) -> scalar`) or `registration=`",
    "the optimizer traces the loss and takes its gradient in the pass that gives the statistics",
  ),
  "regularized_parameters_path_exclusions": Moved(
    _NONE,
    "`l2_reg` is the curvature η I of the L2 term your loss adds, on every parameter; the loss's "
    "own term decides which parameters it regularises",
  ),
  "value_func_has_aux": Moved(_REG.format("has_aux=True"), _SCAN),
  "value_func_has_state": Moved(
    "the state in `batch`, the new one returned as aux (`Registration(..., has_aux=True)`, "
    'read from `info["aux"]`)',
    "the loss signature is `loss_fn(params, batch)`",
  ),
  "value_func_has_rng": Moved(
    "the key in `batch`: `loss_fn(params, (key, data))`",
    "the loss signature is `loss_fn(params, batch)`; `rng` of `step` is the curvature's",
  ),
  "value_func_for_estimator": Moved(_REG.format("curvature_fn=..."), _SCAN),
  "use_adaptive_learning_rate": Moved(
    "learning_rate=None (the Optimizer's default)", "one argument per hyperparameter"
  ),
  "learning_rate_schedule": Moved(
    "learning_rate= (a number or a schedule `step -> α`)", "one argument per hyperparameter"
  ),
  "use_adaptive_momentum": Moved(
    "momentum=None (the Optimizer's default)", "one argument per hyperparameter"
  ),
  "momentum_schedule": Moved(
    "momentum= (a number or a schedule)", "one argument per hyperparameter"
  ),
  "initial_damping": Moved("damping= (the adaptation's start)", "one argument per hyperparameter"),
  "damping_schedule": Moved(
    "damping= (a schedule, with use_adaptive_damping=False)", "one argument per hyperparameter"
  ),
  "use_initial_damping_calibration": Moved(_NONE, "start `damping` near where it settles"),
  "min_damping": Moved("config=kfac_jax.Config(min_damping=...)", _CONFIG),
  "max_damping": Moved("config=kfac_jax.Config(max_damping=...)", _CONFIG),
  "damping_adaptation_interval": Moved(
    "config=kfac_jax.Config(damping_adaptation_interval=...)", _CONFIG
  ),
  "damping_adaptation_decay": Moved(
    "config=kfac_jax.Config(damping_adaptation_decay=...)", _CONFIG
  ),
  "damping_lower_threshold": Moved(_NONE, "the Levenberg–Marquardt thresholds are 1/4 and 3/4"),
  "damping_upper_threshold": Moved(_NONE, "the Levenberg–Marquardt thresholds are 1/4 and 3/4"),
  "include_damping_in_quad_change": Moved(
    _NONE, "the quadratic model M(δ), and so ρ, includes the damping λ + l2_reg"
  ),
  "always_use_exact_qmodel_for_damping_adjustment": Moved(
    _NONE, "ρ always uses the exact quadratic model"
  ),
  "precon_damping_mult": Moved(
    _NONE, "the preconditioner and the quadratic model share the damping λ + l2_reg"
  ),
  "precon_damping_schedule": Moved(
    _NONE, "the preconditioner and the quadratic model share the damping λ + l2_reg"
  ),
  "use_step_rejection": Moved(
    "use_adaptive_damping=True",
    "a step its adaptation measures as raising the loss is never applied",
  ),
  "reject_damping_increase_factor": Moved(
    "config=kfac_jax.Config(damping_adaptation_decay=...)",
    "a rejected step raises λ as any poor step does",
  ),
  "num_burnin_steps": Moved(
    "config=kfac_jax.Config(burn_in_steps=...)",
    "the first steps fold the statistics of their own batches (no data_iterator)",
  ),
  "estimation_mode": Moved(
    _REG.format("estimation_mode=...") + " (fisher_gradients is 'gradients', ggn_exact "
    "'exact_GGN', ...: kfac_jax._migrate.ESTIMATION_MODES)",
    _SCAN,
    _estimation_mode,
  ),
  "num_estimator_samples": Moved(_REG.format("num_samples=..."), _SCAN),
  "should_vmap_estimator_samples": Moved(_NONE, "the samples are drawn in one batched pass"),
  "custom_estimator_ctor": Moved(_BLOCKS, "the estimator is built from the registration"),
  "curvature_ema": Moved("ema_decay=", "renamed"),
  "curvature_update_period": Moved("curvature_every=", "renamed"),
  "inverse_update_period": Moved("inverse_every=", "renamed"),
  "use_exact_inverses": Moved(
    'config=kfac_jax.Config(damping_mode="eigen")', "exact damping of the Kronecker factors"
  ),
  "batch_process_func": Moved(
    "process the batch before `step` (inside your jitted function)",
    "`step` is a pure function of the batch it is given",
  ),
  "register_only_generic": Moved(
    _REG.format('layers=kfac_jax.LayerConfig(defaults={"dense": "diagonal", ...})'), _SCAN
  ),
  "patterns_to_skip": Moved(
    _REG.format('layers=kfac_jax.LayerConfig(overrides={"params/Dense_0/*": "diagonal"})'),
    "layers are chosen by parameter path, not by pattern name",
  ),
  "use_automatic_registration": Moved(
    _NONE, "the scanner always runs; a manual tag (register_dense, ...) wins over it"
  ),
  "auto_register_kwargs": Moved(_REG.format("layers=kfac_jax.LayerConfig(...)"), _SCAN),
  "layer_tag_to_block_ctor": Moved(_REG.format("layers=kfac_jax.LayerConfig(blocks=...)"), _BLOCKS),
  "multi_device": Moved(
    'jax.pmap(opt.step, axis_name="batch") with Optimizer(..., axis_name="batch")',
    "init and step are pure functions: you jit, pmap or shard_map them",
  ),
  "pmap_axis_name": Moved("axis_name=", "renamed"),
  "debug": Moved("call `step` without jax.jit", "the Optimizer never jits itself"),
  "invalid_metric_value": Moved(_NONE, "`info` holds NaN where a value is not computed"),
  "batch_size_extractor": Moved(_NONE, "the loss tags' leading axis is the batch"),
  "forbid_setting_attributes_after_finalize": Moved(
    _NONE, "the Optimizer holds no traced state to protect"
  ),
  "modifiable_attribute_exceptions": Moved(_NONE, "the Optimizer holds no traced state to protect"),
  "include_norms_in_stats": Moved(
    'info["update_norm"]; other norms from params', "`info` holds the step's scalars"
  ),
  "include_per_param_norms_in_stats": Moved(
    "jax.tree.map(jnp.linalg.norm, params)", "`info` holds the step's scalars"
  ),
  "include_registered_loss_in_stats": Moved(
    'info["loss"] (the loss `loss_fn` returns)', "`info` holds the step's scalars"
  ),
  "distributed_precon_apply": Moved(
    "always, with `axis_name` (config=kfac_jax.Config(inverse_storage=...) for the storage)",
    "the inverse work is split over the devices of the data-parallel axis",
  ),
  "distributed_inverses": Moved(
    "always, with `axis_name` (config=kfac_jax.Config(inverse_storage=...) for the storage)",
    "the inverse work is split over the devices of the data-parallel axis",
  ),
  "norm_to_scale_identity_weight_per_block": Moved(
    'config=kfac_jax.Config(damping_mode="factored")', "π-adjusted damping per layer (the default)"
  ),
  "precon_power": Moved(
    "kfac_jax.CurvatureEstimator(registration, exps=(...)).multiply_matpower(state, v, exp)",
    "the fronts precondition with the inverse (power −1)",
  ),
  "exact_quad_model_matrix_type": Moved(
    _NONE, "the quadratic model uses the tagged losses' Gauss-Newton matrix"
  ),
  # -- the transforms: what the Optimizer spelling does not give -----------------------------------
  "kfac.norm_constraint": Moved(
    "max_norm=√C / α",
    "kfac clips the preconditioned gradient's K-FAC norm before the learning rate α scales it; "
    "kfac-jax's C bounds the squared norm of the step after α",
    _max_norm,
  ),
  "scale_by_kfac.norm_constraint": Moved(
    "kfac_jax.kfac(..., max_norm=√C / α)", "the clipping is a piece of kfac's chain"
  ),
  "kfac.l2_reg": Moved(
    "damping=λ + η", "kfac-jax adds l2_reg to the damping; the L2 term stays in the loss"
  ),
  "scale_by_kfac.l2_reg": Moved(
    "damping=λ + η", "kfac-jax adds l2_reg to the damping; the L2 term stays in the loss"
  ),
  # -- the calling conventions: the constructor's first argument, init's and step's order ------
  "Optimizer": Moved(
    "Optimizer(loss_fn, example_batch, *, ...)",
    "the first argument is the loss itself, `loss_fn(params, batch)`, not its jax.value_and_grad",
  ),
  "Optimizer.init": Moved(
    "init(params)",
    "the layers are found from the constructor's loss_fn and example_batch (or registration=); "
    "init takes no key or batch",
  ),
  "Optimizer.init.rng": Moved("init(params)", "init draws nothing"),
  "Optimizer.init.batch": Moved(
    "Optimizer(loss_fn, example_batch) (or registration=)", "the layers are found at construction"
  ),
  "Optimizer.init.func_state": Moved(
    "the state in `batch`", "the loss signature is `loss_fn(params, batch)`"
  ),
  "Optimizer.step": Moved(
    "step(params, state, batch, rng, *, learning_rate=None, momentum=None, damping=None)",
    "the batch comes third and the key fourth; kfac-jax's step(params, state, rng, batch=...) "
    "takes the key third",
  ),
  "Optimizer.step.data_iterator": Moved(
    "batch=next(data_iterator)",
    "step is a pure function of one batch (burn-in: config=kfac_jax.Config(burn_in_steps=...))",
  ),
  "Optimizer.step.func_state": Moved(
    'the state in `batch`, the new one from `info["aux"]` (has_aux=True)',
    "the loss signature is `loss_fn(params, batch)`",
  ),
  "Optimizer.step.global_step_int": Moved(
    "nothing: the state counts the steps (state.step)", "no Python-side counter is needed"
  ),
  # -- module attributes -------------------------------------------------------------------------
  "kfac_jax.utils": Moved(
    "plain JAX (the page's table of the pmap helpers)",
    "the parallel helpers are a few lines of JAX each",
  ),
  "kfac_jax.optimizer": Moved("kfac_jax.Optimizer", "one flat namespace"),
  "kfac_jax.curvature_blocks": Moved("kfac_jax.blocks", "renamed"),
  "kfac_jax.curvature_estimator": Moved("kfac_jax.CurvatureEstimator", "one flat namespace"),
  "kfac_jax.layers_and_loss_tags": Moved(
    "kfac_jax.register_dense, register_conv, register_generic, ... (one flat namespace)",
    "the tags are functions of the package",
  ),
  "kfac_jax.loss_functions": Moved(
    "kfac_jax.register_*_loss and register_*_predictive_distribution",
    "a loss is a tag on the model's output; its class is not public",
  ),
  "kfac_jax.tag_graph_matcher": Moved(
    "kfac_jax.Registration(loss_fn, params, batch, layers=kfac_jax.LayerConfig(...))",
    "the scanner finds layers by following each parameter, not by graph patterns",
  ),
  "kfac_jax.auto_register_tags": Moved(
    "kfac_jax.Registration(loss_fn, params, batch).layers", "the registration runs the scanner"
  ),
  "kfac_jax.register_conv2d": Moved("kfac_jax.register_conv", "one tag for 1-, 2- and 3-D"),
  "kfac_jax.OptaxPreconditioner": Moved(
    "kfac_jax.scale_by_kfac (an optax transformation)", "the curvature state is optax state"
  ),
  "kfac_jax.OptaxPreconditionState": Moved("kfac_jax.ScaleByKfacState", "optax state"),
  "kfac_jax.BlockDiagonalCurvature": Moved(
    "kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))",
    "one estimator, built from the registration",
  ),
  "kfac_jax.ExplicitExactCurvature": Moved(
    "kfac_jax.CurvatureEstimator(...).to_dense(state)", "the block-diagonal matrix, for tests"
  ),
  "kfac_jax.set_default_tag_to_block_ctor": Moved(
    _REG.format("layers=kfac_jax.LayerConfig(blocks=...)"), "no process-wide settings"
  ),
  "kfac_jax.HAIKU_BIASES": Moved(_NONE, "`l2_reg` covers every parameter"),
  "kfac_jax.HAIKU_BIASES_AND_NORMS": Moved(_NONE, "`l2_reg` covers every parameter"),
}
for _name in (
  "CurvatureBlock ScaledIdentity Diagonal Full KroneckerFactored TwoKroneckerFactored "
  "NaiveDiagonal NaiveFull NaiveTNT DenseDiagonal DenseFull DenseTwoKroneckerFactored "
  "RepeatedDenseKroneckerFactored DenseTNT "
  "Conv2DDiagonal Conv2DFull Conv2DTwoKroneckerFactored Conv2DTNT ScaleAndShiftDiagonal "
  "ScaleAndShiftFull"
).split():
  MOVED[f"kfac_jax.{_name}"] = Moved(_BLOCKS, "blocks are chosen per layer by approximation")
for _name in (
  "tracer patches_second_moment patches_moments patches_moments_explicit ProcessedJaxpr "
  "LayerVjpData LayerData LayerMetaData LossTag LayerTag loss_tags_vjp loss_tags_jvp "
  "loss_tags_hvp layer_tags_vjp ImplicitExactCurvature LossFunction NegativeLogProbLoss "
  "DistributionNegativeLogProbLoss NormalMeanNegativeLogProbLoss "
  "NormalMeanVarianceNegativeLogProbLoss MultiBernoulliNegativeLogProbLoss "
  "CategoricalLogitsNegativeLogProbLoss OneHotCategoricalLogitsNegativeLogProbLoss "
  "get_default_tag_to_block_ctor set_max_parallel_elements get_max_parallel_elements "
  "set_default_eigen_decomposition_threshold get_default_eigen_decomposition_threshold"
).split():
  MOVED[f"kfac_jax.{_name}"] = Moved(_NONE, _INTERNAL)

# kfac-jax's positional parameters of `Optimizer.init` and `Optimizer.step`: such a call is read
# as kfac-jax would have bound it.
SIGNATURES: dict[str, tuple[str, ...]] = {
  "Optimizer.init": ("params", "rng", "batch", "func_state"),
  "Optimizer.step": (
    "params",
    "state",
    "rng",
    "data_iterator",
    "batch",
    "func_state",
    "learning_rate",
    "momentum",
    "damping",
    "global_step_int",
  ),
}


def lookup(front: str, name: str) -> Moved | None:
  """The table's entry for kfac-jax's `name` given to `front` ("Optimizer", "kfac", ...)."""
  return MOVED.get(f"{front}.{name}") or MOVED.get(name)


def _line(name: str, moved: Moved, args: dict[str, Any]) -> str:
  computed = moved.computed(args) if moved.computed is not None else None
  return f"  - `{name}` → {computed or moved.spelling} ({moved.reason})"


def moved_error(front: str, own: tuple[str, ...], args: tuple, kwargs: dict[str, Any], python):
  """The TypeError for a call (`args`, `kwargs`) that Python could not bind to the parameters
  `own` of `front`, naming the kfac-jax spellings in it; None when it has none.

  A call of `Optimizer.init` / `Optimizer.step` that binds to kfac-jax's parameters
  (`SIGNATURES`) is read by them and also gets the calling convention's entry; other calls are
  read by the callable's own positional parameters."""
  theirs = SIGNATURES.get(front, ())
  binds = (
    bool(theirs) and len(args) <= len(theirs) and all(n in theirs[len(args) :] for n in kwargs)
  )
  names = theirs if binds else own
  given = {**dict(zip(names, args)), **kwargs}
  read = given if binds else kwargs  # Positional arguments named by our own order are ours.
  lines = [_line(n, m, given) for n in read if (m := lookup(front, n)) is not None]
  convention = MOVED.get(front)
  if convention is not None and (binds or (lines and args)):
    lines.insert(0, f"  - the calling convention → {convention.spelling} ({convention.reason})")
  if not lines:
    return None
  return TypeError(
    f"{front}: {python}. The call is in kfac-jax's spelling; here it is (see {PAGE}):\n"
    + "\n".join(lines)
  )


F = TypeVar("F", bound=Callable[..., Any])


def translated(front: str) -> Callable[[F], F]:
  """Wraps a callable so that a call Python cannot bind raises `moved_error` when it uses
  kfac-jax's spellings (`front`: the role, "Optimizer", "Optimizer.step", "kfac", ...); the
  wrapper shows the callable's own signature (`inspect.signature`, `help()`)."""

  def wrap(fn: F) -> F:
    @functools.wraps(fn)
    def call(*args, **kwargs):
      try:
        return fn(*args, **kwargs)
      except TypeError as e:
        # Raised while binding the arguments: no frame of `fn` was entered.
        if e.__traceback__ is None or e.__traceback__.tb_next is not None:
          raise
        params = [
          p.name
          for p in inspect.signature(fn).parameters.values()
          if p.kind is p.POSITIONAL_OR_KEYWORD
        ]
        method = bool(params) and params[0] == "self"
        error = moved_error(front, tuple(params[method:]), args[method:], kwargs, e)
        if error is None:
          raise
        raise error from None

    return call  # type: ignore[return-value]  # functools.wraps keeps fn's signature

  return wrap


def missing_attribute(name: str) -> AttributeError:
  """The AttributeError for `kfac_jax.<name>`, naming its spelling here if it is kfac-jax's."""
  moved = MOVED.get(f"kfac_jax.{name}")
  text = f"module 'kfac_jax' has no attribute {name!r}"
  if moved is not None:
    text += f": kfac-jax's `kfac_jax.{name}` → {moved.spelling} ({moved.reason}); see {PAGE}."
  return AttributeError(text)
