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
  """The loss tags' negative log-likelihood is not (a multiple of) the loss `loss_fn` returns, as
  measured on the example batch; the curvature is then of another loss than the one trained."""


class HyperparameterWarning(UserWarning):
  """A schedule gave a hyperparameter that is not finite, or a negative learning rate or
  damping: the step it gave it for is skipped (with `Config.skip_nonfinite`). Also `kfac`'s
  learning rate far outside the range measured on the benchmark models (more than 30 times
  its default or below 1/1000 of it): the step is taken."""


class NonFiniteWarning(UserWarning):
  """A front was given a gradient, params or (the `Optimizer`) a loss that is not finite: the
  step is skipped (with `Config.skip_nonfinite`) and the curvature is left as it was."""


class FailedInverseWarning(UserWarning):
  """A block's refreshed inverse (its cache: powers, decompositions) was not finite, so the block
  keeps its previous one (the identity before its first good refresh) and
  `curvature.failed_inverses` counts it; given once per layer by a front."""
