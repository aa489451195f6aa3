"""Parent-side helpers for the upstream kfac-jax contestant of the benchmarks.

`run_worker` writes the inputs, starts `worker.py` in the upstream virtualenv and reads its
report back (or raises `UpstreamFailed` with the worker's exception line); `run_vmc_worker` does
the same for `vmc_worker.py` (benchmarks/vmc.py). The rest is pure
Python + numpy (no JAX, no upstream package), used by `benchmarks/_harness.py` for every
contestant and unit-tested in `tests/benchmarks/test_upstream.py`: per-run summaries, loss
smoothing, "time to reach a loss", the curves' time axis and the plot.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "worker.py")
VMC_WORKER = os.path.join(HERE, "vmc_worker.py")
SETUP = os.path.join(HERE, "setup_venv.sh")
DEFAULT_PYTHON = os.path.join(ROOT, ".venv-upstream", "bin", "python")


# -- parameters <-> npz ----------------------------------------------------------------------------


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
  """`{"params": {"dense_0": {"kernel": w}}}` -> `{"param:params/dense_0/kernel": w}`."""
  out = {}
  for key, value in tree.items():
    if "/" in str(key):
      raise ValueError(
        f"parameter key {key!r} under {prefix or '<root>'!r} contains '/', which "
        "the npz exchange format uses as its path separator."
      )
    path = f"{prefix}/{key}" if prefix else str(key)
    if isinstance(value, Mapping):
      out.update(flatten_params(value, path))
    else:
      out[f"param:{path}"] = np.asarray(value)
  return out


def unflatten_params(arrays: Mapping[str, np.ndarray]) -> dict:
  """Inverse of `flatten_params` (keys without the `param:` prefix are ignored)."""
  tree: dict = {}
  for key, value in arrays.items():
    if not key.startswith("param:"):
      continue
    *parents, leaf = key[len("param:") :].split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = np.asarray(value)
  return tree


# -- running the worker ----------------------------------------------------------------------------


def ensure_venv(python: str | None) -> str:
  """The upstream venv's python: `python` if given, else the default one (created if missing)."""
  if python:
    if not os.path.isfile(python):
      raise FileNotFoundError(
        f"--upstream-python {python!r} does not exist; run "
        f"`bash {os.path.relpath(SETUP, ROOT)}` or pass an existing "
        "interpreter that has kfac-jax 0.0.8 installed."
      )
    return python
  proc = subprocess.run(["bash", SETUP], capture_output=True, text=True, check=False)
  sys.stderr.write(proc.stderr)
  if proc.returncode != 0:
    raise RuntimeError(f"{SETUP} failed (exit {proc.returncode}); see the messages above.")
  return proc.stdout.strip().splitlines()[-1]


class UpstreamFailed(RuntimeError):
  """The worker exited with an error: `exception` is its exception line (e.g. `ValueError:
  ...`), `registrations` upstream's layer registrations if it got that far."""

  def __init__(self, returncode: int, tail: str, exception: str | None, registrations: str | None):
    super().__init__(f"the upstream worker failed (exit {returncode}):\n{tail}")
    self.exception = exception
    self.registrations = registrations


def exception_line(stderr: str) -> str | None:
  """The last `SomeError: message` line of a Python traceback (None if there is none)."""
  for line in reversed(stderr.splitlines()):
    if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?", line.strip()):
      return line.strip()
  return None


def registrations_line(stdout: str) -> str | None:
  """The worker's `upstream registrations: [...]` line, without the label."""
  for line in stdout.splitlines():
    if line.startswith("upstream registrations:"):
      return line[len("upstream registrations:") :].strip()
  return None


def run_worker(
  python: str,
  params,
  images: np.ndarray | Mapping[str, np.ndarray],
  idx: np.ndarray,
  config: Mapping[str, Any],
  timeout: float | None = None,
) -> tuple[dict, dict]:
  """Trains with upstream kfac-jax in a subprocess; returns (report, final params tree).

  `images` is the example pool: an array (the batch is `images[idx[t]]`) or a dict of arrays
  with a common first axis (the batch is `{k: v[idx[t]]}`). Only the examples that `idx` uses
  are sent (`batches` index into them), so a short run does not write the whole training set to
  disk.
  """
  used, inverse = np.unique(idx, return_inverse=True)
  if isinstance(images, Mapping):
    pool = {f"data:{k}": np.asarray(v)[used] for k, v in images.items()}
  else:
    pool = {"images": np.asarray(images[used], np.float32)}
  with tempfile.TemporaryDirectory(prefix="kfac_upstream_") as tmp:
    inputs = os.path.join(tmp, "inputs.npz")
    np.savez(
      inputs, batches=inverse.reshape(idx.shape).astype(np.int64), **pool, **flatten_params(params)
    )
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
      json.dump(dict(config), f)
    report = _run_script(python, [WORKER, inputs, cfg_path, tmp], tmp, timeout)
    with np.load(os.path.join(tmp, "final_params.npz")) as z:
      final = unflatten_params({k: z[k] for k in z.files})
  return report, final


def run_vmc_worker(python: str, config: Mapping[str, Any], timeout: float | None = None) -> dict:
  """Trains examples/vmc.py's wave function with upstream kfac-jax (`vmc_worker.py`, whose
  docstring lists `config`'s keys) in a subprocess; returns its report."""
  with tempfile.TemporaryDirectory(prefix="kfac_upstream_vmc_") as tmp:
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
      json.dump(dict(config), f)
    return _run_script(python, [VMC_WORKER, cfg_path, tmp], tmp, timeout)


def _run_script(python: str, args: Sequence[str], out_dir: str, timeout: float | None) -> dict:
  """Runs a worker without this repository on PYTHONPATH; returns `out_dir/result.json`."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run(
    [python, *args],
    cwd=out_dir,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  if proc.returncode != 0:
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    raise UpstreamFailed(
      proc.returncode, tail, exception_line(proc.stderr), registrations_line(proc.stdout)
    )
  with open(os.path.join(out_dir, "result.json")) as f:
    return json.load(f)


# -- summaries -------------------------------------------------------------------------------------


def summarize(
  name: str, step_times: Sequence[float], losses: Sequence[float], warmup: int, **extra
) -> dict:
  """Step-time statistics over the timed steps (after `warmup`), as the benchmark reports them."""
  times = np.asarray(step_times, dtype=float)
  losses = np.asarray(losses, dtype=float)
  if warmup >= len(times):
    raise ValueError(f"warmup={warmup} leaves no timed step out of {len(times)}.")
  timed = times[warmup:]
  out = {
    "optimizer": name,
    "median_step_ms": 1e3 * float(np.median(timed)),
    "mean_step_ms": 1e3 * float(np.mean(timed)),
    "min_step_ms": 1e3 * float(np.min(timed)),
    "timed_steps": len(timed),
    "loss_steps": len(times),
    "last_minibatch_loss": float(losses[-1]),
    "finite": bool(np.all(np.isfinite(losses))),
  }
  out.update(extra)
  return out


def smoothed(losses: Sequence[float], window: int) -> np.ndarray:
  """Trailing moving average: entry t is the mean of losses[max(0, t-window+1) : t+1]."""
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}.")
  x = np.asarray(losses, dtype=float)
  c = np.concatenate([[0.0], np.cumsum(x)])
  t = np.arange(len(x))
  lo = np.maximum(0, t - window + 1)
  return (c[t + 1] - c[lo]) / (t + 1 - lo)


def time_to_reach(
  losses: Sequence[float], step_times: Sequence[float], target: float, window: int
) -> tuple[int, float] | None:
  """First (step, seconds) at which the smoothed loss is <= `target`, or None if never.

  The loss at step t is measured on the parameters after t updates (before update t), so it is
  available after `sum(step_times[:t])` seconds of training: the returned seconds.
  """
  s = smoothed(losses, window)
  hits = np.nonzero(s <= target)[0]
  if hits.size == 0:
    return None
  t = int(hits[0])
  return t, float(np.sum(np.asarray(step_times, dtype=float)[:t]))


def curve_times(step_times: Sequence[float], period: int) -> np.ndarray:
  """Step times for the loss-vs-seconds curves: the first step's time replaced by the median of
  the later steps in the same phase (`t % period == 0`, i.e. the other inverse-update steps),
  or of all later steps if there is none.

  The first step carries one-off costs: upstream's compilation (its step compiles on first
  call), buffer allocation and thread-pool start-up for every contestant. Replacing it the same
  way for all runs keeps the time axis about training only.
  """
  t = np.asarray(step_times, dtype=float).copy()
  if t.size < 2:
    return t
  same_phase = t[period::period] if period >= 1 else t[1:]
  t[0] = float(np.median(same_phase if same_phase.size else t[1:]))
  return t


def plot_curves(
  curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], out: str, title: str
) -> None:
  """PNG with the minibatch loss against steps and against seconds, one line per optimizer.

  `curves` maps a name to (losses, step_times); the loss at step t is plotted at
  `sum(step_times[:t])` seconds, when the parameters it was measured on became available.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_steps, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
  for k, (name, (losses, times)) in enumerate(curves.items()):
    losses = np.asarray(losses, dtype=float)
    elapsed = np.concatenate([[0.0], np.cumsum(np.asarray(times, dtype=float))[:-1]])
    # Long names (a race's `--kfac-configs` settings) wrapped, so the legend keeps to its axes.
    style = {"color": f"C{k}", "lw": 1.2, "label": textwrap.fill(name, 40)}
    ax_steps.plot(np.arange(1, len(losses) + 1), losses, **style)
    ax_time.plot(elapsed, losses, **style)
  ax_steps.set_xlabel("step")
  ax_time.set_xlabel("seconds of training steps (compilation and first-step costs excluded)")
  for ax in (ax_steps, ax_time):
    ax.set_yscale("log")
    ax.set_ylabel("training loss (minibatch)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
