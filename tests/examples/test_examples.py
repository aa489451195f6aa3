"""Smoke tests for the examples: each trains K-FAC and Adam end to end and writes a PNG.

Each runs with `--fast` and KFAC_DATA_DIR pointed at an empty directory, so it uses the small
scikit-learn digits fallback (fast, and independent of installed data). The scripts run as their
`main(argv)` in this process (a subprocess would pay the imports and JAX's start-up again, 3-5 s
each); the data-parallel example, which sets its own device count before JAX starts, runs in a
fresh process.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from examples import autoencoder, autoencoder_adaptive, cnn, rnn, transformer_lm, vmc  # noqa: E402
from tests import _scripts  # noqa: E402

pytestmark = pytest.mark.slow  # Every test here trains small models end to end.


def _run_fast(main, tmp_path, png_name, monkeypatch, capsys, extra=(), progress=False):
  """An example's `main` with `--fast` on the digits fallback, its PNG checked; returns
  (stdout, all output)."""
  out = tmp_path / png_name
  argv = ["--fast", *([] if progress else ["--no-progress"]), "--out", str(out), *extra]
  stdout, output = _scripts.run_main(main, argv, tmp_path, monkeypatch, capsys)
  assert out.is_file() and out.stat().st_size > 1000, output
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "non-finite" not in output
  return stdout, output


def test_autoencoder_demo_fast_with_a_time_budget(tmp_path, monkeypatch, capsys):
  """The demo's default mode, small: each optimizer trains for the same timed seconds. (The
  fixed-step mode runs in the adaptive demo's test, which shares `train`.)"""
  stdout, output = _run_fast(
    autoencoder.main, tmp_path, "ae.png", monkeypatch, capsys, ["--seconds", "0.5"], True
  )
  # Something is printed before each compile, and the bars' postfix reads "s, loss=..., step=".
  assert "K-FAC: compiling the step" in output and " Adam: compiling the step" in output, output
  assert "[," not in output and re.search(r" s, loss=[0-9.]+, step=\d+", output), output
  assert "falling back" in output  # the empty KFAC_DATA_DIR forced the digits fallback
  assert "0.5 s of timed steps each" in output, output
  for name in ("K-FAC", "Adam"):
    row = re.search(
      rf"^\| {re.escape(name)} \| ([0-9.]+) \| [0-9.]+ \| (\d+) \| [0-9.]+ \| "
      rf"[0-9.]+ \| ([0-9.]+) \|",
      stdout,
      re.M,
    )
    assert row is not None, output
    assert float(row.group(1)) < 1e4, output  # finite and not diverged
    steps, seconds = int(row.group(2)), float(row.group(3))
    # Steps start while the timed seconds are below the budget, so the last one ends past it
    # (how many fit depends on the machine).
    assert steps >= 1 and seconds >= 0.5, output


def test_autoencoder_adaptive_demo_fast(tmp_path, monkeypatch, capsys):
  """examples/autoencoder_adaptive.py: full-batch adaptive K-FAC beside Adam, PNG written."""
  stdout, output = _run_fast(
    autoencoder_adaptive.main, tmp_path, "ae_adaptive.png", monkeypatch, capsys
  )
  initial = float(re.search(r"^initial loss: ([0-9.]+)$", stdout, re.M).group(1))
  for name in ("K-FAC (adaptive)", "Adam"):
    row = re.search(rf"^\| {re.escape(name)} \| ([0-9.]+) \|", stdout, re.M)
    assert row is not None, output
    assert float(row.group(1)) < initial, output  # both made progress
  assert re.search(r"skipped steps: 0$", stdout, re.M), output


def test_cnn_example_fast(tmp_path, monkeypatch, capsys):
  """examples/cnn.py: conv + LayerNorm + dense found without tags; K-FAC and Adam train."""
  stdout, output = _run_fast(cnn.main, tmp_path, "cnn.png", monkeypatch, capsys)
  for kind in ("conv", "scale_and_shift", "dense"):
    assert kind in stdout, output  # the summary table
  assert "generic" not in stdout, output
  for name in ("K-FAC", "Adam"):
    row = re.search(rf"^\| {re.escape(name)} \| ([0-9.]+) \| ([0-9.]+) \|", stdout, re.M)
    assert row is not None, output
    assert float(row.group(1)) < 10.0, output  # finite, not diverged


def test_data_parallel_example_fast(tmp_path):
  """examples/data_parallel.py: 4 fake devices under pmap agree with one device to round-off."""
  empty = tmp_path / "no_data"
  empty.mkdir()
  env = dict(os.environ, KFAC_DATA_DIR=str(empty), MPLBACKEND="Agg")
  # The example sets its own device count; the suite's other XLA flags stay.
  env["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
  ).strip()
  out = tmp_path / "dp.png"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(_ROOT, "examples", "data_parallel.py"),
      "--fast",
      "--devices",
      "4",
      "--batch-size",
      "128",
      "--no-progress",
      "--out",
      str(out),
    ],
    cwd=str(tmp_path),
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "4 devices" in proc.stdout, output
  rel = float(re.search(r"/ max \|params\|: ([0-9.e+-]+)", proc.stdout).group(1))
  assert rel < 1e-5, output


def test_walkthrough_notebook_runs(tmp_path, monkeypatch):
  """Every code cell of examples/walkthrough.ipynb, in order, in one namespace of this process
  (no second interpreter's imports to pay). The notebook turns float64 on; it is turned back
  off afterwards."""
  with open(os.path.join(_ROOT, "examples", "walkthrough.ipynb"), encoding="utf-8") as f:
    nb = json.load(f)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  scope = {"__name__": "walkthrough"}
  x64 = jax.config.jax_enable_x64
  try:
    for i, cell in enumerate(nb["cells"]):
      if cell["cell_type"] == "code":
        code = compile("".join(cell["source"]), f"walkthrough.ipynb cell {i}", "exec")
        exec(code, scope)  # noqa: S102 - The notebook asserts K-FAC == exact Fisher itself.
  finally:
    jax.config.update("jax_enable_x64", x64)
    if "plt" in scope:
      scope["plt"].close("all")
  losses = scope["losses"]
  assert losses[-1] < 0.5 * losses[0], losses
  assert (tmp_path / "walkthrough.png").is_file()


def test_transformer_lm_example_fast(tmp_path, monkeypatch, capsys):
  """examples/transformer_lm.py: attention, LayerNorm, tied embeddings; K-FAC and Adam train."""
  stdout, output = _run_fast(transformer_lm.main, tmp_path, "lm.png", monkeypatch, capsys)
  assert "MultiHeadDotProductAttention_0/query" in stdout, output
  # The tied table is one embedding layer used twice, not a generic fallback.
  assert re.search(r"^params/Embed_0\s+embedding\s+2\s+kron_indep", stdout, re.M), output
  assert "fallback" not in stdout, output
  for name in ("K-FAC", "Adam"):
    row = re.search(rf"^\| {re.escape(name)} \| ([0-9.]+) \|", stdout, re.M)
    assert row is not None, output
    assert float(row.group(1)) < 4.2, output  # below the uniform log(vocab) ≈ 4.4: it learned


def test_rnn_example_fast(tmp_path, monkeypatch, capsys):
  """examples/rnn.py: the recurrent kernel is one layer with T uses and a series block."""
  stdout, output = _run_fast(rnn.main, tmp_path, "rnn.png", monkeypatch, capsys)
  assert re.search(r"^W_h\s+dense \(manual\)\s+8\s+kron_series_1", stdout, re.M), output
  assert "fallback" not in stdout, output
  # Below the uniform log(82) = 4.41 for K-FAC (6 steps suffice); Adam only has to stay sane.
  for name, bound in (("K-FAC (series)", 4.2), ("K-FAC (indep)", 4.2), ("Adam", 4.6)):
    row = re.search(rf"^\| {re.escape(name)} \| ([0-9.]+) \|", stdout, re.M)
    assert row is not None, output
    assert float(row.group(1)) < bound, output


@pytest.mark.parametrize("optimizer", ["optimizer", "kfac"])
def test_vmc_fast(optimizer, capsys):
  """The VMC example's `--fast` run on He with each K-FAC front: finite energies, printed
  with the exact value beside them."""
  out = vmc.main(["--fast", "--optimizer", optimizer])
  assert out["energies"].shape == (6,) and all(abs(e) < 50 for e in out["energies"])
  assert "exact -2.90372" in capsys.readouterr().out


def test_vmc_trains_with_a_callable_optimizer():
  """`vmc.train` runs another optimizer's step in its own loop (how kfac-jax 0.0.8 is plugged
  in): here SGD at the schedule's rate; the update is timed apart from the sampling."""
  made = []

  def make(loss_fn, params, batch, schedule, damping, key):
    made.append((batch["r"].shape, damping))

    @jax.jit
    def step(params, t, batch, key):
      energy, grads = jax.value_and_grad(loss_fn)(params, batch)
      return jax.tree.map(lambda p, g: p - schedule(t) * g, params, grads), t + 1, energy

    return step, jnp.zeros([])

  # The `--fast` run's network and walkers: its sampler's programs, compiled already.
  net = vmc.Net(one=8, two=4, layers=1, determinants=1)
  out = vmc.train(vmc.SYSTEMS["He"], net, make, steps=3, walkers=16, damping=0.25)
  assert made == [((16, 2, 3), 0.25)]
  assert out["energies"].shape == (3,) and np.all(np.isfinite(out["energies"]))
  assert np.all(out["update_times"] > 0) and np.all(out["update_times"] < out["times"])


def test_pinn_poisson_fast(tmp_path, monkeypatch, capsys):
  """The Poisson PINN: every parameter in a dense layer shared by the points and tangents,
  K-FAC (the Optimizer, the kfac chain with a line search) and Adam rows with finite errors,
  and the plot."""
  from examples import pinn_poisson

  stdout, output = _run_fast(pinn_poisson.main, tmp_path, "pinn.png", monkeypatch, capsys)
  assert "hold 257 of 257 parameters" in stdout, output
  for name in ("K-FAC", "kfac line search", "Adam"):
    row = re.search(rf"^\| {name} \| \d+ \| [0-9.]+ \| ([0-9.e+-]+) \|", stdout, re.M)
    assert row is not None, output
    assert float(row.group(1)) < 10, output
