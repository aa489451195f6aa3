"""kfac_jax: K-FAC (Kronecker-factored approximate curvature) for JAX, as optax transforms.

Mark the loss with a tag inside your ordinary loss function; layers are found automatically.

    def loss_fn(params, batch):
      logits = model.apply(params, batch["x"])
      kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3)
    opt_state = tx.init(params)
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
"""

from kfac_jax import _migrate, pinn  # `pinn`: a module of its own, `kfac_jax.pinn.laplacian`.
from kfac_jax._checkpoint import (
  check_restored_state,
  restore_state,
  state_from_bytes,
  state_to_bytes,
)
from kfac_jax._compile import compile_step
from kfac_jax._config import Config
from kfac_jax._curvature import CurvatureStats
from kfac_jax._errors import (
  FailedInverseWarning,
  HyperparameterWarning,
  LossMismatchWarning,
  NonFiniteWarning,
  RegistrationCheckError,
  RegistrationError,
  UncoveredParametersWarning,
)
from kfac_jax._estimator import CurvatureEstimator, EstimatorState
from kfac_jax._optimizer import KfacOptaxState, Optimizer, OptimizerState
from kfac_jax._parallel import ShardedCache
from kfac_jax._registration import Registration, StatsKey, value_and_grad
from kfac_jax._storage import ReplicatedStorage, ShardedStorage
from kfac_jax._summary import check_registration, summary
from kfac_jax._tags import (
  register_categorical_predictive_distribution,
  register_conv,
  register_dense,
  register_embedding,
  register_generic,
  register_multi_bernoulli_predictive_distribution,
  register_normal_predictive_distribution,
  register_scale_and_shift,
  register_sigmoid_cross_entropy_loss,
  register_softmax_cross_entropy_loss,
  register_squared_error_loss,
)
from kfac_jax._transform import KfacState, ScaleByKfacState, kfac, scale_by_kfac
from kfac_jax.blocks import Block, BlockConfig
from kfac_jax.kernel import (
  KernelNgdState,
  KernelState,
  ScaleByKernelNgdState,
  kernel_ngd,
  scale_by_kernel_ngd,
)
from kfac_jax.scan import LayerConfig, LayerSpec

__version__ = "0.1.0.dev0"


def __getattr__(name: str):
  """kfac-jax's module attributes raise an AttributeError naming their spelling here."""
  raise _migrate.missing_attribute(name)


__all__ = [
  "Block",
  "BlockConfig",
  "Config",
  "CurvatureEstimator",
  "CurvatureStats",
  "EstimatorState",
  "KfacOptaxState",
  "KernelNgdState",
  "KernelState",
  "KfacState",
  "LayerConfig",
  "LayerSpec",
  "FailedInverseWarning",
  "HyperparameterWarning",
  "LossMismatchWarning",
  "NonFiniteWarning",
  "Optimizer",
  "OptimizerState",
  "Registration",
  "ReplicatedStorage",
  "RegistrationCheckError",
  "RegistrationError",
  "ScaleByKernelNgdState",
  "ScaleByKfacState",
  "ShardedCache",
  "ShardedStorage",
  "StatsKey",
  "UncoveredParametersWarning",
  "check_registration",
  "check_restored_state",
  "compile_step",
  "kernel_ngd",
  "kfac",
  "pinn",
  "register_categorical_predictive_distribution",
  "register_conv",
  "register_dense",
  "register_embedding",
  "register_generic",
  "register_multi_bernoulli_predictive_distribution",
  "register_normal_predictive_distribution",
  "register_scale_and_shift",
  "register_sigmoid_cross_entropy_loss",
  "register_softmax_cross_entropy_loss",
  "register_squared_error_loss",
  "restore_state",
  "scale_by_kernel_ngd",
  "scale_by_kfac",
  "state_from_bytes",
  "state_to_bytes",
  "summary",
  "value_and_grad",
]
