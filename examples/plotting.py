"""The examples' plot: each run's curve against steps and against seconds, side by side."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np


def steps_and_seconds(
  curves: Sequence[tuple[str, np.ndarray, np.ndarray, np.ndarray]],
  out: str,
  *,
  title: str,
  ylabel: str,
  seconds: str = "seconds (compilation excluded)",
  log_x: bool = False,
  colors: Mapping[str, str] | None = None,
) -> None:
  """Writes a PNG to `out`: `(name, steps, seconds, values)` per curve, values on a log axis
  against steps (left) and seconds (right); with `log_x`, steps and seconds on log axes too."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for name, steps, secs, values in curves:
    c = (colors or {}).get(name)
    axes[0].plot(steps, values, label=name, color=c, lw=1.2)
    axes[1].plot(secs, values, label=name, color=c, lw=1.2)
  axes[0].set_xlabel("step")
  axes[1].set_xlabel(seconds)
  for ax in axes:
    ax.set_yscale("log")
    if log_x:
      ax.set_xscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
