"""DeepMind kfac-jax's spellings, for those who move a script over (docs/from_kfac_jax.rst): one
table (`MOVED`: a kfac-jax name → its spelling here and why), read by the TypeError of a call
Python cannot bind (`translated`) and the AttributeError of a missing attribute."""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

PAGE = "docs/from_kfac_jax.rst"


class Moved(NamedTuple):
  """A kfac-jax name's spelling here, why, and optionally a function of the call's arguments
  (kfac-jax's names → values) giving the spelling with those values (None: not computable)."""

  spelling: str
  reason: str
  computed: Callable[[dict[str, Any]], str | None] | None = None


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
# A cell of the table that is one of these names stands for its text.
_SHARED = {
  "NONE": "no equivalent",
  "HYPER": "one argument per hyperparameter",
  "CONFIG": "a rare knob: `Config` holds them for every front",
  "SIGNATURE": "the loss signature is `loss_fn(params, batch)`",
  "INFO": "`info` holds the step's scalars",
  "LM": "the Levenberg–Marquardt thresholds are 1/4 and 3/4",
  "DAMPING": "the preconditioner and the quadratic model share the damping λ + l2_reg",
  "UNPROTECTED": "the Optimizer holds no traced state to protect",
  "SPLIT": "always, with `axis_name` (config=kfac_jax.Config(inverse_storage=...) for the storage)",
  "L2": "kfac-jax adds l2_reg to the damping; the L2 term stays in the loss",
  "BLOCKS": (
    "kfac_jax.Block for a block of your own, `LayerConfig(blocks={pattern: cls})`; a layer's "
    'approximation is a string (`LayerConfig(overrides={"params/Dense_0/*": "diagonal"})`)'
  ),
  "SCAN": "a setting of the scan: the registration's, shared by every front",
}

# The table: `name | spelling | reason`, a row at the margin continued on indented lines. A name
# "front.name" is that front's own entry (a keyword of `Optimizer.step`, kfac's
# `norm_constraint`); a bare name is a keyword of kfac-jax's `Optimizer` as every front here
# reads it; "kfac_jax.name" is a module attribute; "Optimizer.init" / "Optimizer.step" the
# calling convention. A spelling "REG args" is `_REG` with those arguments.
_TABLE = """
value_and_grad_func | loss_fn (the loss itself, `loss_fn(params, batch) -> scalar`) or
  `registration=` | its gradient comes from the pass that gives the statistics
regularized_parameters_path_exclusions | NONE | `l2_reg` is the L2 term's curvature η I, on
  every parameter; your loss's own term picks the parameters it regularises
value_func_has_aux | REG has_aux=True | SCAN
value_func_for_estimator | REG curvature_fn=... | SCAN
value_func_has_state | the state in `batch`, the new one returned as aux
  (`Registration(..., has_aux=True)`, read from `info["aux"]`) | SIGNATURE
value_func_has_rng | the key in `batch`: `loss_fn(params, (key, data))` | `rng` feeds the curvature
use_adaptive_learning_rate | learning_rate=None (the Optimizer's default) | HYPER
learning_rate_schedule | learning_rate= (a number or a schedule `step -> α`) | HYPER
use_adaptive_momentum | momentum=None (the Optimizer's default) | HYPER
momentum_schedule | momentum= (a number or a schedule) | HYPER
initial_damping | damping= (the adaptation's start) | HYPER
damping_schedule | damping= (a schedule, with use_adaptive_damping=False) | HYPER
use_initial_damping_calibration | NONE | start `damping` near where it settles
min_damping | config=kfac_jax.Config(min_damping=...) | CONFIG
max_damping | config=kfac_jax.Config(max_damping=...) | CONFIG
damping_adaptation_interval | config=kfac_jax.Config(damping_adaptation_interval=...) | CONFIG
damping_adaptation_decay | config=kfac_jax.Config(damping_adaptation_decay=...) | CONFIG
damping_lower_threshold | NONE | LM
damping_upper_threshold | NONE | LM
include_damping_in_quad_change | NONE | the quadratic model M(δ), and so ρ, includes λ + l2_reg
always_use_exact_qmodel_for_damping_adjustment | NONE | ρ always uses the exact quadratic model
precon_damping_mult | NONE | DAMPING
precon_damping_schedule | NONE | DAMPING
use_step_rejection | use_adaptive_damping=True | a step measured to raise the loss is not applied
reject_damping_increase_factor | config=kfac_jax.Config(damping_adaptation_decay=...) | a rejected
  step raises λ as any poor step does
num_burnin_steps | config=kfac_jax.Config(burn_in_steps=...) | early steps fold their own batches
estimation_mode | REG estimation_mode=... | renamed modes: kfac_jax._migrate.ESTIMATION_MODES
num_estimator_samples | REG num_samples=... | SCAN
should_vmap_estimator_samples | NONE | the samples are drawn in one batched pass
custom_estimator_ctor | BLOCKS | the estimator is built from the registration
curvature_ema | ema_decay= | renamed
curvature_update_period | curvature_every= | renamed
inverse_update_period | inverse_every= | renamed
pmap_axis_name | axis_name= | renamed
use_exact_inverses | config=kfac_jax.Config(damping_mode="eigen") | exact damping of the factors
batch_process_func | process the batch before `step` (inside your jitted function) | `step` is pure
register_only_generic | REG layers=kfac_jax.LayerConfig(defaults={"dense": "diagonal", ...}) |
  SCAN
patterns_to_skip | REG layers=kfac_jax.LayerConfig(overrides={"params/Dense_0/*": "diagonal"}) |
  layers are chosen by parameter path, not by pattern name
use_automatic_registration | NONE | the scanner always runs; a manual tag wins over it
auto_register_kwargs | REG layers=kfac_jax.LayerConfig(...) | SCAN
layer_tag_to_block_ctor | REG layers=kfac_jax.LayerConfig(blocks=...) | BLOCKS
multi_device | jax.pmap(opt.step, axis_name="batch") with Optimizer(..., axis_name="batch") |
  init and step are pure functions: you jit, pmap or shard_map them
debug | call `step` without jax.jit | the Optimizer never jits itself
invalid_metric_value | NONE | `info` holds NaN where a value is not computed
batch_size_extractor | NONE | the loss tags' leading axis is the batch
forbid_setting_attributes_after_finalize | NONE | UNPROTECTED
modifiable_attribute_exceptions | NONE | UNPROTECTED
include_norms_in_stats | info["update_norm"]; other norms from params | INFO
include_per_param_norms_in_stats | jax.tree.map(jnp.linalg.norm, params) | INFO
include_registered_loss_in_stats | info["loss"] (the loss `loss_fn` returns) | INFO
distributed_precon_apply | SPLIT | the inverse work is split over the data-parallel devices
distributed_inverses | SPLIT | the inverse work is split over the data-parallel devices
norm_to_scale_identity_weight_per_block | config=kfac_jax.Config(damping_mode="factored") |
  π-adjusted damping per layer (the default)
precon_power | kfac_jax.CurvatureEstimator(registration,
  exps=(...)).multiply_matpower(state, v, exp) | the fronts use the inverse (power −1)
exact_quad_model_matrix_type | NONE | the quadratic model uses the tagged losses' GGN
kfac.norm_constraint | max_norm=√C / α | kfac clips the preconditioned gradient's K-FAC norm
  before the learning rate α scales it; kfac-jax's C bounds the squared norm of the step after α
scale_by_kfac.norm_constraint | kfac_jax.kfac(..., max_norm=√C / α) | the clipping is in kfac
kfac.l2_reg | damping=λ + η | L2
scale_by_kfac.l2_reg | damping=λ + η | L2
Optimizer | Optimizer(loss_fn, example_batch, *, ...) | the loss itself, not its jax.value_and_grad
Optimizer.init | init(params) | the constructor finds the layers; init takes no key or batch
Optimizer.init.rng | init(params) | init draws nothing
Optimizer.init.batch | Optimizer(loss_fn, example_batch) (or registration=) | the constructor scans
Optimizer.init.func_state | the state in `batch` | SIGNATURE
Optimizer.step | step(params, state, batch, rng, *, learning_rate=None, momentum=None,
  damping=None) | the batch comes third and the key fourth (kfac-jax: the key third)
Optimizer.step.data_iterator | batch=next(data_iterator) | burn-in: Config(burn_in_steps=...)
Optimizer.step.func_state | the state in `batch`, the new one from `info["aux"]` (has_aux=True) |
  SIGNATURE
Optimizer.step.global_step_int | nothing: the state counts the steps (state.step) | none needed
kfac_jax.utils | plain JAX (the page's table of the pmap helpers) | each is a few lines of JAX
kfac_jax.optimizer | kfac_jax.Optimizer | one flat namespace
kfac_jax.curvature_blocks | kfac_jax.blocks | renamed
kfac_jax.curvature_estimator | kfac_jax.CurvatureEstimator | one flat namespace
kfac_jax.layers_and_loss_tags | kfac_jax.register_dense, register_conv, ... | one flat namespace
kfac_jax.loss_functions | kfac_jax.register_*_loss / *_predictive_distribution | a loss is a tag
kfac_jax.tag_graph_matcher | kfac_jax.Registration(loss_fn, params, batch,
  layers=kfac_jax.LayerConfig(...)) | the scanner follows each parameter, not graph patterns
kfac_jax.auto_register_tags | kfac_jax.Registration(loss_fn, params, batch).layers | the
  registration runs the scanner
kfac_jax.register_conv2d | kfac_jax.register_conv | one tag for 1-, 2- and 3-D
kfac_jax.OptaxPreconditioner | kfac_jax.scale_by_kfac (an optax transformation) | optax state
kfac_jax.OptaxPreconditionState | kfac_jax.ScaleByKfacState | optax state
kfac_jax.BlockDiagonalCurvature | kfac_jax.CurvatureEstimator(registration) | one estimator
kfac_jax.ExplicitExactCurvature | kfac_jax.CurvatureEstimator(...).to_dense(state) | block-diagonal
kfac_jax.set_default_tag_to_block_ctor | REG layers=kfac_jax.LayerConfig(blocks=...) | no
  process-wide settings
kfac_jax.HAIKU_BIASES | NONE | `l2_reg` covers every parameter
kfac_jax.HAIKU_BIASES_AND_NORMS | NONE | `l2_reg` covers every parameter
"""
# kfac-jax's block classes, and its tracer's and losses' internals.
_BLOCK_CLASSES = """CurvatureBlock ScaledIdentity Diagonal Full KroneckerFactored
  TwoKroneckerFactored NaiveDiagonal NaiveFull NaiveTNT DenseDiagonal DenseFull
  DenseTwoKroneckerFactored RepeatedDenseKroneckerFactored DenseTNT Conv2DDiagonal Conv2DFull
  Conv2DTwoKroneckerFactored Conv2DTNT ScaleAndShiftDiagonal ScaleAndShiftFull"""
_INTERNALS = """tracer patches_second_moment patches_moments patches_moments_explicit
  ProcessedJaxpr LayerVjpData LayerData LayerMetaData LossTag LayerTag loss_tags_vjp
  loss_tags_jvp loss_tags_hvp layer_tags_vjp ImplicitExactCurvature LossFunction
  NegativeLogProbLoss DistributionNegativeLogProbLoss NormalMeanNegativeLogProbLoss
  NormalMeanVarianceNegativeLogProbLoss MultiBernoulliNegativeLogProbLoss
  CategoricalLogitsNegativeLogProbLoss OneHotCategoricalLogitsNegativeLogProbLoss
  get_default_tag_to_block_ctor set_max_parallel_elements get_max_parallel_elements
  set_default_eigen_decomposition_threshold get_default_eigen_decomposition_threshold"""


def _estimation_mode(args: dict[str, Any]) -> str | None:
  mode = args.get("estimation_mode")
  here = ESTIMATION_MODES.get(mode) if isinstance(mode, str) else None
  return None if here is None else _REG.format(f"estimation_mode={here!r}")


def _max_norm(args: dict[str, Any]) -> str | None:
  c, alpha = args.get("norm_constraint"), args.get("learning_rate")
  if not (isinstance(c, (int, float)) and isinstance(alpha, (int, float)) and c > 0 < alpha):
    return None
  return f"max_norm=√C / α = {math.sqrt(c) / alpha:.6g}"


def _spelling(cell: str) -> str:
  return _REG.format(cell[4:]) if cell.startswith("REG ") else _SHARED.get(cell, cell)


def _rows() -> dict[str, Moved]:
  rows = (row.split(" | ") for row in re.sub(r"\n +", " ", _TABLE.strip()).splitlines())
  table = {name: Moved(_spelling(s), _SHARED.get(r, r)) for name, s, r in rows}
  internal = "the tracer's internals are not public: kfac_jax.Registration(...) scans the loss"
  for names, moved in (
    (_BLOCK_CLASSES, Moved(_SHARED["BLOCKS"], "blocks are chosen per layer by approximation")),
    (_INTERNALS, Moved("no equivalent", internal)),
  ):
    table.update({f"kfac_jax.{name}": moved for name in names.split()})
  table["estimation_mode"] = table["estimation_mode"]._replace(computed=_estimation_mode)
  table["kfac.norm_constraint"] = table["kfac.norm_constraint"]._replace(computed=_max_norm)
  return table


MOVED: dict[str, Moved] = _rows()

# kfac-jax's positional parameters of `Optimizer.init` and `Optimizer.step`: such a call is read
# as kfac-jax would have bound it.
SIGNATURES: dict[str, tuple[str, ...]] = {
  "Optimizer.init": ("params", "rng", "batch", "func_state"),
  "Optimizer.step": tuple(
    "params state rng data_iterator batch func_state learning_rate momentum damping "
    "global_step_int".split()
  ),
}


def _line(name: str, moved: Moved, args: dict[str, Any]) -> str:
  computed = moved.computed(args) if moved.computed is not None else None
  return f"  - `{name}` → {computed or moved.spelling} ({moved.reason})"


def moved_error(front: str, own: tuple[str, ...], args: tuple, kwargs: dict[str, Any], python):
  """The TypeError for a call Python could not bind to `front`'s parameters `own`, naming the
  kfac-jax spellings in it; None when it has none."""
  theirs = SIGNATURES.get(front, ())
  binds = (
    bool(theirs) and len(args) <= len(theirs) and all(n in theirs[len(args) :] for n in kwargs)
  )
  names = theirs if binds else own
  given = {**dict(zip(names, args)), **kwargs}
  read = given if binds else kwargs  # Positional arguments named by our own order are ours.
  lines = [
    _line(n, m, given) for n in read if (m := MOVED.get(f"{front}.{n}") or MOVED.get(n)) is not None
  ]
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
  kfac-jax's spellings (`front`: the role, "Optimizer", "Optimizer.step", "kfac", ...)."""

  def wrap(fn: F) -> F:
    signature = inspect.signature(fn).parameters.values()
    params = [p.name for p in signature if p.kind is p.POSITIONAL_OR_KEYWORD]
    method = bool(params) and params[0] == "self"

    @functools.wraps(fn)
    def call(*args, **kwargs):
      try:
        return fn(*args, **kwargs)
      except TypeError as e:
        # Raised while binding the arguments: no frame of `fn` was entered.
        if e.__traceback__ is None or e.__traceback__.tb_next is not None:
          raise
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
