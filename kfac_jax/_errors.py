"""Every public error and warning kfac_jax raises or emits, in one place."""

from __future__ import annotations

from collections.abc import Sequence


class RegistrationError(ValueError):
  """A loss or layer registration problem, found while scanning `loss_fn`."""


class RegistrationCheckError(RegistrationError):
  """Every coverage problem of one registration, listed together (`check_registration`).

  Attributes:
    problems: one line per problem, each naming the parameter path(s).
  """

  def __init__(self, problems: Sequence[str]):
    self.problems = tuple(problems)
    lines = "\n".join(f"  - {p}" for p in self.problems)
    super().__init__(f"{len(self.problems)} registration problem(s):\n{lines}")


class UncoveredParametersWarning(UserWarning):
  """Parameters not in any recognised layer; they get a diagonal generic block."""


class LossMismatchWarning(UserWarning):
  """The loss tags' negative log-likelihood is not (a multiple of) the loss `loss_fn` returns on
  the example batch."""


class HyperparameterWarning(UserWarning):
  """A schedule gave a non-finite hyperparameter or a negative learning rate or damping (the step
  is skipped), or `kfac`'s learning rate is over 30x or under 1/1000 of its default."""


class NonFiniteWarning(UserWarning):
  """A front was given a gradient, params or (the `Optimizer`) a loss that is not finite: the
  step is skipped (with `Config.skip_nonfinite`) and the curvature is left as it was."""


class FailedInverseWarning(UserWarning):
  """A block's refreshed inverse was not finite, so the block keeps its previous one and
  `curvature.failed_inverses` counts it; given once per layer by a front."""
