"""Tests for the issue-6 benchmarks: the shared harness, the plain-jax models of the upstream
worker, and each benchmark script run tiny (`--quick`) on CPU: its `main(argv)` in this process
(no second set of imports and JAX start-up; the suite is compile-bound), or, with upstream, as
a subprocess (the command line).

The script runs use the scikit-learn digits fallback (KFAC_DATA_DIR points at an empty
directory) and check that the JSON and the printed table have every contestant and every metric.
The upstream runs need kfac-jax 0.0.8 in its own venv (`.venv-upstream/`, or the interpreter in
`$KFAC_UPSTREAM_PYTHON`) and are skipped without one.
"""

import argparse
import json
import math
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

from benchmarks import _harness  # noqa: E402
from benchmarks.upstream import compare, plain_models  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import cnn as cnn_lib  # noqa: E402
from examples import transformer_lm as lm  # noqa: E402
from tests import _scripts  # noqa: E402


@pytest.fixture(autouse=True)
def _digits_fallback(tmp_path_factory, monkeypatch):
  """Every script here (and the processes it starts) reads an empty KFAC_DATA_DIR, so it runs
  on the small scikit-learn digits fallback whatever data the machine has installed."""
  monkeypatch.setenv("KFAC_DATA_DIR", str(tmp_path_factory.mktemp("no_data")))


_METRICS = (
  "setup_s",
  "compile_s",
  "median_step_ms",
  "mean_step_ms",
  "peak_bytes",
  "opt_state_bytes",
  "final_eval_loss",
)


# -- pure helpers ---------------------------------------------------------------------------------


def test_tree_bytes_counts_every_leaf_including_keys():
  tree = {
    "a": jnp.zeros((3, 4), jnp.float32),
    "b": (jnp.zeros(5, jnp.int8),),
    "k": jax.random.key(0),
    "n": np.zeros(2, np.float64),
  }
  want = 48 + 5 + jax.random.key_data(jax.random.key(0)).nbytes + 16
  assert _harness.tree_bytes(tree) == want


def test_compiled_footprint_is_argument_output_temp_minus_alias():
  x = jnp.ones((64, 32), jnp.float32)
  fp = _harness.compiled_footprint(jax.jit(lambda a: a * 2.0).lower(x).compile())
  assert fp["argument"] == x.nbytes and fp["output"] == x.nbytes
  assert fp["total"] == fp["argument"] + fp["output"] + fp["temp"] - fp["alias"]
  donated = _harness.compiled_footprint(
    jax.jit(lambda a: a * 2.0, donate_argnums=0).lower(x).compile()
  )
  assert donated["total"] < fp["total"]  # the output reuses the donated input buffer


def test_peak_fields():
  exact = _harness._peak_fields(100, 250, None)
  assert exact["peak_bytes"] == 250 and exact["peak_exact"]
  bound = _harness._peak_fields(300, 300, None)  # the peak did not rise: only an upper bound
  assert bound["peak_bytes"] == 300 and not bound["peak_exact"]
  proxy = _harness._peak_fields(None, None, {"total": 42})
  assert proxy["peak_bytes"] == 42 and "memory_analysis" in proxy["peak_source"]


def test_ratios_and_table():
  base = {
    "optimizer": "Adam (tuned, lr=0.001)",
    "setup_s": 0.1,
    "compile_s": 1.0,
    "median_step_ms": 10.0,
    "mean_step_ms": 12.0,
    "peak_bytes": 2 * 2**20,
    "peak_exact": True,
    "opt_state_bytes": 2**20,
    "final_eval_loss": 2.0,
    "finite": True,
    "time_to_target": (9, 3.0),
    "time_to_target_s": 3.0,
  }
  kfac = dict(
    base,
    optimizer="kfac_jax (optax)",
    compile_s=3.0,
    median_step_ms=25.0,
    mean_step_ms=30.0,
    peak_bytes=6 * 2**20,
    peak_exact=False,
    opt_state_bytes=4 * 2**20,
    final_eval_loss=1.5,
    time_to_target=(4, 1.5),
    time_to_target_s=1.5,
  )
  slow = dict(
    base, optimizer="SGD+momentum", time_to_target=None, time_to_target_s=None, peak_bytes=None
  )
  failed = {"optimizer": "upstream", "error": "ValueError: shapes a | b"}
  q = _harness.ratios(kfac, base)
  assert q == pytest.approx(
    {
      "compile": 3.0,
      "median_step": 2.5,
      "mean_step": 2.5,
      "peak_memory": 3.0,
      "opt_state": 4.0,
      "loss": 0.75,
      "time_to_target": 0.5,
    }
  )
  assert _harness.ratios(slow, base)["time_to_target"] is None
  assert _harness.ratios(slow, base)["peak_memory"] is None
  table = _harness.markdown_table(
    [base, kfac, slow, failed], [("kfac_jax (optax) / Adam (tuned)", q)], 10, 1.25
  )
  lines = table.splitlines()
  assert lines[0].endswith("| loss after 10 steps | steps to 1.25 | seconds to 1.25 |")
  assert lines[2] == (
    "| Adam (tuned, lr=0.001) | 0.10 | 1.00 | 10.0 | 12.0 | 2.0 | 1.00 | 2 | 9 | 3.00 |"
  )
  assert lines[3] == (
    "| kfac_jax (optax) | 0.10 | 3.00 | 25.0 | 30.0 | <=6.0 | 4.00 | 1.5 | 4 | 1.50 |"
  )
  assert lines[4].endswith("| n/a | 1.00 | 2 | not reached | not reached |")
  assert lines[5].startswith("| upstream | failed: ValueError: shapes a / b |")
  assert lines[6] == (
    "| **kfac_jax (optax) / Adam (tuned)** | | 3.00x | 2.50x | 2.50x | "
    "3.00x | 4.00x | 0.750x | | 0.50x |"
  )


def _fake_run(name, family, losses, times, final, lr=None):
  summary = {
    "optimizer": name,
    "family": family,
    "final_eval_loss": final,
    "hyperparameters": {} if lr is None else {"learning_rate": lr},
    "compile_s": 1.0,
    "median_step_ms": 1.0,
    "mean_step_ms": 1.0,
  }
  return _harness.Run(name, np.asarray(losses, float), np.asarray(times, float), 1, summary)


def test_compare_runs_picks_tuned_adam_and_times_to_its_loss():
  runs = [
    _fake_run("Adam lr=0.01", "adam", [10, 8, 6, 5], [5, 2, 2, 2], 5.5, lr=0.01),
    _fake_run("Adam lr=0.001", "adam", [10, 9, 8, 7], [5, 2, 2, 2], 7.0, lr=0.001),
    _fake_run("Adam lr=1", "adam", [10, float("nan")] * 2, [5, 2, 2, 2], float("nan"), lr=1.0),
    _fake_run("SGD+momentum", "sgd", [10, 9.5, 9, 8.5], [1, 1, 1, 1], 8.0),
    _fake_run("kfac_jax (optax)", "kfac", [10, 5, 4, 3], [9, 1, 1, 1], 2.5),
  ]
  failed = {"optimizer": "up", "family": "upstream", "error": "ValueError: no"}
  rep = _harness.compare_runs(runs, failed, reach_window=5, total_steps=4)
  assert rep["best"] is runs[0] and rep["tuned"]["optimizer"] == "Adam (tuned, lr=0.01)"
  assert [g["learning_rate"] for g in rep["grid"]] == [0.01, 0.001, 1.0]
  assert rep["window"] == 1 and rep["target"] == 5.0  # 4 steps: no smoothing
  # Adam reaches 5 at step 3; its first step (5 s) counts as a typical one (2 s): 6 s.
  assert rep["tuned"]["time_to_target"] == (3, 6.0)
  assert runs[4].summary["time_to_target"] == (1, 1.0)  # K-FAC: step 1, after 1 s
  assert runs[3].summary["time_to_target"] is None  # SGD never gets there
  assert [r["optimizer"] for r in rep["rows"]] == [
    "Adam (tuned, lr=0.01)",
    "SGD+momentum",
    "kfac_jax (optax)",
    "up",
  ]
  labels = [label for label, _ in rep["ratio_rows"]]
  assert labels == ["SGD+momentum / Adam (tuned)", "kfac_jax (optax) / Adam (tuned)"]
  assert rep["ratio_rows"][1][1]["time_to_target"] == pytest.approx(1 / 6)
  assert rep["ratio_rows"][1][1]["loss"] == pytest.approx(2.5 / 5.5)
  with pytest.raises(ValueError, match="needs at least one Adam run"):
    _harness.compare_runs(runs[3:], None, reach_window=5, total_steps=4)


def test_compare_runs_reports_time_to_upstreams_loss_against_its_budget():
  runs = [
    _fake_run("Adam lr=0.01", "adam", [10, 8, 6, 5], [5, 2, 2, 2], 5.5, lr=0.01),
    _fake_run("kfac_jax (optax)", "kfac", [10, 5, 4, 3], [9, 1, 1, 1], 2.5),
    _fake_run("kfac_jax Optimizer", "kfac_optimizer", [10, 9, 9, 9], [1, 1, 1, 1], 9.0),
  ]
  upstream = _fake_run("up", "upstream", [10, 6, 5, 4], [9, 3, 3, 3], 4.0)
  rep = _harness.compare_runs(runs, upstream, reach_window=5, total_steps=4)
  vs = rep["vs_upstream"]
  # Upstream ends at loss 4 after 12 s (its first step counts as a typical 3 s one).
  assert vs["loss"] == 4.0 and vs["budget_s"] == 12.0
  assert vs["runs"]["kfac_jax (optax)"] == {"time_to_loss": (2, 2.0), "fraction": 2.0 / 12.0}
  assert vs["runs"]["kfac_jax Optimizer"] == {"time_to_loss": None, "fraction": None}
  line = _harness.upstream_budget_line(vs)
  assert "kfac_jax (optax) at step 2 after 2.00 s (0.17x)" in line
  assert "kfac_jax Optimizer not within its run" in line
  assert _harness.compare_runs(runs, None, reach_window=5, total_steps=4)["vs_upstream"] is None


def test_worker_output_parsing():
  err = "Traceback (most recent call last):\n  File x\n    y\nValueError: Incompatible shapes\n"
  assert compare.exception_line(err) == "ValueError: Incompatible shapes"
  assert compare.exception_line("no traceback here") is None
  out = 'hello\nupstream registrations: [{"kind": "dense", "params": ["a"]}]\nbye'
  assert json.loads(compare.registrations_line(out)) == [{"kind": "dense", "params": ["a"]}]
  assert compare.registrations_line("nothing") is None


# -- the upstream worker's plain-jax models equal the Flax ones -----------------------------------


def _perturbed(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    treedef, [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
  )


def _init(model, x, seed=2):
  """Perturbed initial parameters, in one jitted program (eager, each op compiles its own)."""
  return jax.jit(lambda x: _perturbed(model.init(jax.random.key(0), x), seed))(x)


def test_plain_autoencoder_matches_flax(x64):
  model = ae.make_model(12, (8, 6, 3))
  x = jax.random.uniform(jax.random.key(1), (5, 12), jnp.float64)
  params = _init(model, x)
  acts = ["linear" if i in (2, 5) else "tanh" for i in range(6)]
  plain, flax_out = jax.jit(lambda p, x: (plain_models.autoencoder(p, x, acts), model.apply(p, x)))(
    params, x
  )
  np.testing.assert_allclose(plain, flax_out, rtol=1e-12, atol=1e-12)
  with pytest.raises(ValueError, match=r"activations\[0\] must be 'tanh' or 'linear', got 'relu'"):
    plain_models.autoencoder(params, x, ["relu"] * 6)


def test_plain_cnn_matches_flax(x64):
  model = cnn_lib.CNN(channels=(3, 5))
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1), jnp.float64)
  params = _init(model, x)
  plain, flax_out = jax.jit(lambda p, x: (plain_models.cnn(p, x, 2), model.apply(p, x)))(params, x)
  np.testing.assert_allclose(plain, flax_out, rtol=1e-10, atol=1e-10)


def test_plain_transformer_matches_flax_and_layout_round_trips(x64):
  model = lm.LM(vocab=11, d=8, layers=2, heads=2, length=6)
  ids = jax.random.randint(jax.random.key(1), (3, 6), 0, 11)
  params = _perturbed(model.init(jax.random.key(0), ids), 2)
  flat = plain_models.attention_to_2d(params)
  q = flat["params"]["Block_1"]["MultiHeadDotProductAttention_0"]
  assert q["query"]["kernel"].shape == (8, 8) and q["query"]["bias"].shape == (8,)
  assert q["out"]["kernel"].shape == (8, 8)
  np.testing.assert_allclose(
    plain_models.transformer(flat, ids, 2, 2), model.apply(params, ids), rtol=1e-10, atol=1e-10
  )
  back = plain_models.attention_from_2d(flat, heads=2)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


# -- the scripts, tiny ----------------------------------------------------------------------------


def _env(tmp_path):
  empty = tmp_path / "no_data"
  empty.mkdir(exist_ok=True)
  env = dict(os.environ, KFAC_DATA_DIR=str(empty), MPLBACKEND="Agg")
  # Neither the suite's device count nor its compile-speed flags: the upstream interpreter's
  # XLA may not know the latter.
  flags = re.sub(
    r"--xla_force_host_platform_device_count=8"
    r"|--xla_cpu_(use_fusion_emitters|parallel_codegen_split_count)=\S+",
    "",
    env.get("XLA_FLAGS", ""),
  )
  if flags.strip():
    env["XLA_FLAGS"] = flags.strip()
  else:
    env.pop("XLA_FLAGS", None)
  return env


def _run(tmp_path, script, *flags):
  out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(_ROOT, "benchmarks", script),
      "--quick",
      "--json",
      str(out_json),
      "--plot",
      str(out_png),
      *flags,
    ],
    cwd=str(tmp_path),
    env=_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=600,
  )
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output
  assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with open(out_json) as f:
    return json.load(f), proc.stdout, output


def _run_here(tmp_path, monkeypatch, capsys, script, *flags):
  """`_run` in this process (`_scripts.run_main`): the script module's `main`, same flags
  and files."""
  out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
  stdout, output = _scripts.run_main(
    script.main,
    ["--quick", "--json", str(out_json), "--plot", str(out_png), *flags],
    tmp_path,
    monkeypatch,
    capsys,
  )
  assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with open(out_json) as f:
    return json.load(f), stdout, output


def _check_report(report, stdout, output, names, adam_lrs):
  rows = {r["optimizer"]: r for r in report["results"]}
  tuned = report["adam_tuned"]
  assert tuned.startswith("Adam (tuned, lr=") and tuned in rows, output
  assert [g["learning_rate"] for g in report["adam_grid"]] == adam_lrs
  assert len(report["adam_grid_results"]) == len(adam_lrs)
  best = min(report["adam_grid"], key=lambda g: g["final_eval_loss"])
  assert tuned == f"Adam (tuned, lr={best['learning_rate']:g})"
  for name in (tuned, *names):
    row = rows[name]
    assert "error" not in row, row
    for key in _METRICS:
      assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (name, key, row)
      assert row[key] >= 0, (name, key, row)
    assert row["peak_bytes"] > 0 and row["opt_state_bytes"] > 0, row
    assert row["finite"], row
    assert "time_to_target" in row, row
    assert re.search(rf"^\| {re.escape(name)} \| [0-9.]+ \| [0-9.]+ \|", stdout, re.M), output
    curve = report["curves"][report["adam_tuned_run"] if name == tuned else name]
    assert len(curve["losses"]) == len(curve["step_times_s"]) == row["loss_steps"]
  # Adam (tuned) reaches its own final loss by definition.
  assert rows[tuned]["time_to_target"] is not None
  for name in names:
    assert f"{name} / Adam (tuned)" in report["ratios"], report["ratios"].keys()
    assert f"| **{name} / Adam (tuned)** |" in stdout, output
  assert "Adam grid (final loss per learning rate): " in stdout
  env = report["env"]
  assert env["backend"] == "cpu" and env["device"].startswith("cpu") and env["jax"]
  assert "--quick" in env["command"]


@pytest.mark.slow
def test_autoencoder_benchmark_full_batch_quick(tmp_path, monkeypatch, capsys):
  # Every contestant kind but one Adam grid is checked here, where compiling is cheapest: SGD,
  # the transform and the Optimizer (the other scripts share `_harness`'s contestants).
  from benchmarks import autoencoder

  report, stdout, output = _run_here(
    tmp_path,
    monkeypatch,
    capsys,
    autoencoder,
    "--full-batch",
    "--encoder",
    "16,4",
    "--steps",
    "3",
    "--adam-lrs",
    "1e-3,3e-3",
  )
  names = ["SGD+momentum", "kfac_jax (optax)", "kfac_jax Optimizer"]
  _check_report(report, stdout, output, names, [1e-3, 3e-3])
  assert "full batch of 256 images" in report["env"]["description"], output
  assert report["env"]["description"].startswith("64-16-4-16-64 autoencoder"), output
  assert report["results"][0]["loss_steps"] == 4  # 1 warm-up + 3 timed
  kinds = {r["kind"] for r in report["kfac_jax_registrations"]}
  assert kinds == {"dense"}, report["kfac_jax_registrations"]


@pytest.mark.slow
def test_cnn_benchmark_quick_with_statistics_every_second_step(tmp_path, monkeypatch, capsys):
  # One Adam learning rate: the tuned one's pick from a grid is checked by the autoencoder's
  # test (and test_compare_runs_picks_tuned_adam_and_times_to_its_loss).
  from benchmarks import cnn

  report, stdout, output = _run_here(
    tmp_path,
    monkeypatch,
    capsys,
    cnn,
    "--steps",
    "3",
    "--adam-lrs",
    "2e-3",
    "--curvature-every",
    "2",
    "--inverse-every",
    "2",
    "--no-sgd",
    "--no-optimizer",
  )
  _check_report(report, stdout, output, ["kfac_jax (optax), statistics every 2"], [2e-3])
  assert report["hyperparameters"]["kfac_jax (optax), statistics every 2"]["curvature_every"] == 2
  kinds = {r["kind"] for r in report["kfac_jax_registrations"]}
  assert kinds == {"conv", "scale_and_shift", "dense"}, report["kfac_jax_registrations"]


@pytest.mark.slow
def test_transformer_benchmark_quick(tmp_path, monkeypatch, capsys):
  # One Adam learning rate: picking the tuned one from a grid is checked by the autoencoder's
  # test (and test_compare_runs_picks_tuned_adam_and_times_to_its_loss); the SGD and Optimizer
  # rows by the autoencoder's.
  from benchmarks import transformer

  report, stdout, output = _run_here(
    tmp_path,
    monkeypatch,
    capsys,
    transformer,
    "--steps",
    "3",
    "--adam-lrs",
    "1e-2",
    "--no-sgd",
    "--no-optimizer",
  )
  _check_report(report, stdout, output, ["kfac_jax (optax)"], [1e-2])
  tied = [
    r for r in report["kfac_jax_registrations"] if r["params"] == ["params/Embed_0/embedding"]
  ]
  assert [r["kind"] for r in tied] == ["embedding (2 uses)"], report["kfac_jax_registrations"]


def test_bad_flags_are_named(capsys):
  from benchmarks import autoencoder, transformer

  for argv, message in (
    (["--adam-lrs", "1e-3,x"], "--adam-lrs must be comma-separated numbers, got '1e-3,x'"),
    (["--adam-lrs", "0"], "--adam-lrs needs at least one learning rate > 0, got '0'"),
    (["--with-upstream", "--warmup", "0"], "--with-upstream needs --warmup >= 1"),
    (["--encoder", "16,x"], "--encoder must be comma-separated integers, got '16,x'"),
    (["--encoder", "16,0"], "--encoder widths must be >= 1, got '16,0'"),
    (
      ["--curvature-every", "6", "--inverse-every", "5"],
      "--curvature-every (6) must be at most --inverse-every (5)",
    ),
  ):
    with pytest.raises(SystemExit):
      autoencoder.parse_args(argv)
    assert message in capsys.readouterr().err
  with pytest.raises(SystemExit):
    transformer.parse_args(["--width", "10", "--heads", "4"])
  assert "--width 10 must be a multiple of --heads 4" in capsys.readouterr().err
  args = autoencoder.parse_args(["--quick"])
  assert (args.steps, args.warmup, args.batch_size, args.adam_lr_grid) == (
    6,
    1,
    128,
    [3e-4, 1e-3, 3e-3],
  )


def test_upstream_failure_is_a_row_with_the_reason(tmp_path):
  """A missing upstream interpreter gives an error row (the table prints `failed: ...`)."""
  params = {"params": {"dense_0": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}}}
  workload = _harness.Workload(
    name="tiny",
    description="",
    loss_fn=None,
    params0=params,
    batch_at=lambda t: np.zeros((1, 2), np.float32),
    eval_fn=lambda p: 0.0,
    eval_description="",
    upstream={"model": "autoencoder", "activations": ["linear"]},
    upstream_data=lambda steps: (np.zeros((1, 2), np.float32), np.zeros((steps, 1), int)),
  )
  missing = str(tmp_path / "missing" / "python")
  args = argparse.Namespace(
    upstream_python=missing,
    kfac_lr=0.1,
    kfac_momentum=0.9,
    damping=1.0,
    ema_decay=0.95,
    inverse_every=5,
    seed=0,
    compile_repeats=1,
  )
  row = _harness.run_upstream(workload, args, 2)
  assert row["optimizer"] == _harness.UPSTREAM_NAME and row["family"] == "upstream", row
  assert f"--upstream-python {missing!r} does not exist" in row["error"], row
  table = _harness.markdown_table([row], [], 2, None)
  assert f"| {_harness.UPSTREAM_NAME} | failed: --upstream-python" in table, table


def test_upstream_config_follows_the_transform_or_with_adaptive_the_optimizer():
  """`--upstream-adaptive` configures upstream as its examples do, from the Optimizer
  contestant's initial damping; without it, like the transform."""
  workload = _harness.Workload(
    name="tiny",
    description="",
    loss_fn=None,
    params0={},
    batch_at=lambda t: None,
    eval_fn=lambda p: 0.0,
    eval_description="",
    upstream={"model": "autoencoder"},
  )
  args = argparse.Namespace(
    kfac_lr=0.3,
    kfac_momentum=0.7,
    damping=0.1,
    optimizer_damping=10.0,
    ema_decay=0.95,
    inverse_every=5,
    curvature_every=1,
    seed=0,
    upstream_adaptive=False,
  )
  cfg = _harness._upstream_config(workload, args, budget_s=3.0)
  assert cfg["adaptive"] is False and cfg["damping"] == 0.1 and cfg["learning_rate"] == 0.3
  assert cfg["model"] == "autoencoder" and cfg["budget_s"] == 3.0
  assert _harness._upstream_hyperparameters(args)["damping"] == 0.1
  args.upstream_adaptive = True
  cfg = _harness._upstream_config(workload, args)
  assert cfg["adaptive"] is True and cfg["damping"] == 10.0
  assert _harness._upstream_hyperparameters(args)["initial_damping"] == 10.0


def _upstream_python():
  python = os.environ.get("KFAC_UPSTREAM_PYTHON") or compare.DEFAULT_PYTHON
  return python if os.path.isfile(python) else None


_NEEDS_UPSTREAM = pytest.mark.skipif(
  _upstream_python() is None,
  reason="no upstream venv (bash benchmarks/upstream/setup_venv.sh, or "
  "KFAC_UPSTREAM_PYTHON=/path/to/python)",
)


@_NEEDS_UPSTREAM
def test_setup_venv_finds_the_venv_ready_with_this_repository_on_pythonpath():
  """The benchmarks start `setup_venv.sh` from a process whose PYTHONPATH holds this repository;
  its check still imports upstream's kfac_jax and skips pip (no index is reachable here)."""
  venv = os.path.dirname(os.path.dirname(_upstream_python()))
  env = {**os.environ, "PYTHONPATH": _ROOT, "UPSTREAM_VENV": venv, "PIP_NO_INDEX": "1"}
  proc = subprocess.run(
    ["bash", compare.SETUP], env=env, capture_output=True, text=True, timeout=120, check=False
  )
  assert proc.returncode == 0 and "skipping pip" in proc.stderr, proc.stderr
  assert proc.stdout.strip().endswith(os.path.join(venv, "bin", "python")), proc.stdout


@_NEEDS_UPSTREAM
@pytest.mark.slow
def test_transformer_benchmark_with_upstream(tmp_path):
  """Upstream kfac-jax 0.0.8 trains the tied-embedding Transformer beside ours."""
  report, stdout, output = _run(
    tmp_path,
    "transformer.py",
    "--steps",
    "2",
    "--adam-lrs",
    "1e-2",
    "--no-sgd",
    "--no-optimizer",
    "--with-upstream",
    "--upstream-python",
    _upstream_python(),
  )
  up = report["results"][-1]
  assert up["family"] == "upstream" and "error" not in up, up
  assert up["optimizer"] == _harness.UPSTREAM_NAME
  for key in ("compile_s", "median_step_ms", "opt_state_bytes", "final_eval_loss"):
    assert math.isfinite(up[key]) and up[key] > 0, (key, up)
  kinds = {r["kind"] for r in up["registrations"]}
  assert "repeated_dense" in kinds and "scale_and_shift" in kinds, up["registrations"]
  assert "kfac_jax (optax) / upstream" in report["ratios"]
  assert "| **kfac_jax (optax) / upstream** |" in stdout, output
  assert "its layer registrations:" in stdout, output


# -- the race (benchmarks/race.py) ---------------------------------------------------------------


class _FakeClock:
  """`clock()` for `run_for_budget`: time moves only when a fake step spends it."""

  def __init__(self, durations):
    self.now, self.durations, self.prepared = 0.0, list(durations), []

  def __call__(self):
    return self.now

  def prepare(self, t):
    self.now += 100.0  # Preparing a batch is never charged.
    self.prepared.append(t)
    return t

  def step(self, t, prepared):
    assert prepared == t
    self.now += self.durations[t]


def test_charged_seconds_counts_the_first_step_as_a_typical_one():
  assert _harness.charged_seconds([], 1) == 0.0
  assert _harness.charged_seconds([9.0], 1) == 0.0  # a lone first step: its cost is unknown
  assert _harness.charged_seconds([9.0, 1.0, 2.0], 1) == pytest.approx(1.5 + 1.0 + 2.0)
  # Period 2: the first step is charged as the median of the later steps of its phase (t even).
  assert _harness.charged_seconds([9.0, 1.0, 4.0, 1.0, 6.0], 2) == pytest.approx(5 + 1 + 4 + 1 + 6)


@pytest.mark.parametrize("period", [1, 3])
def test_incremental_charge_equals_charged_seconds(period):
  times = list(np.random.default_rng(period).exponential(size=40))
  charger = _harness._Charger(period)
  for k, dt in enumerate(times):
    assert charger.seconds() == pytest.approx(_harness.charged_seconds(times[:k], period))
    charger.add(dt)
  assert charger.seconds() == pytest.approx(_harness.charged_seconds(times, period))


def test_run_for_budget_charges_each_step_and_stops_once_the_budget_is_spent():
  clock = _FakeClock([50.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0])
  times = _harness.run_for_budget(clock.prepare, clock.step, 5.0, period=1, clock=clock)
  # Charged after each step: 0 (lone first), 2, 4.5 (first = median(1, 2)), 5 -> stop: 4 steps.
  assert times == [50.0, 1.0, 2.0, 1.0]
  assert clock.prepared == [0, 1, 2, 3]
  assert _harness.charged_seconds(times, 1) == pytest.approx(5.0)
  # A step starts only while the budget is not spent: the last one may overshoot it.
  clock = _FakeClock([1.0, 1.0, 10.0, 1.0])
  assert _harness.run_for_budget(clock.prepare, clock.step, 2.5, clock=clock) == [1.0, 1.0, 10.0]
  clock = _FakeClock([1.0] * 10)
  assert (
    len(_harness.run_for_budget(clock.prepare, clock.step, 100.0, max_steps=3, clock=clock)) == 3
  )
  with pytest.raises(ValueError, match="budget must be > 0 seconds, got 0"):
    _harness.run_for_budget(clock.prepare, clock.step, 0.0)


def _race_run(name, family, losses, times, final, lr=None, period=1):
  summary = _harness.race_summary(
    name,
    family,
    np.asarray(losses, float),
    times,
    period,
    10.0,
    hyperparameters={} if lr is None else {"learning_rate": lr},
    compile_s=1.0,
    final_eval_loss=final,
  )
  return _harness.Run(name, np.asarray(losses, float), np.asarray(times, float), period, summary)


def test_race_compare_times_every_run_to_the_tuned_adams_loss():
  runs = [
    _race_run("Adam lr=0.01", "adam", [10, 8, 6, 5], [5, 2, 2, 2], 5.5, lr=0.01),
    _race_run("Adam lr=0.1", "adam", [10, 9, 8, 7], [5, 2, 2, 2], 7.0, lr=0.1),
    _race_run("Muon lr=0.02", "muon", [10, 7, 6, 6], [1, 1, 1, 1], 6.0, lr=0.02),
    _race_run("Muon lr=0.05", "muon", [10, 4, 3, 2], [1, 1, 1, 1], float("nan"), lr=0.05),
    _race_run("kfac", "kfac", [10, 5, 4, 3], [9, 3, 3, 3], 2.5),
    _race_run("sgd", "sgd", [10, 9.5, 9, 8.5], [1, 1, 1, 1], 8.0),
    _race_run("SOAP lr=0.01", "soap", [10, 8, 7, 6], [3, 3, 3, 3], 6.5, lr=0.01),
    _race_run("SOAP lr=0.003", "soap", [10, 6, 5, 4], [3, 3, 3, 3], 4.5, lr=0.003),
  ]
  assert runs[0].summary["steps"] == 4 and runs[0].summary["charged_s"] == 8.0
  assert runs[0].summary["mean_step_ms"] == pytest.approx(2000.0)
  assert runs[4].summary["mean_step_ms"] == pytest.approx(3000.0)
  rep = _harness.race_compare(runs, reach_window=5)
  assert rep["window"] == 1 and rep["target"] == 5.0
  # Adam reaches 5 at step 3: 3 steps of 2 s charged (its first one as a typical one).
  assert runs[0].summary["time_to_target"] == (3, 6.0) and rep["adam_seconds"] == 6.0
  assert runs[4].summary["time_to_target"] == (1, 3.0)
  assert runs[4].summary["vs_adam"] == pytest.approx(0.5)
  assert runs[2].summary["vs_adam"] is None and runs[5].summary["time_to_target"] is None
  assert runs[3].summary["vs_adam"] == pytest.approx(1 / 6)  # a NaN eval does not hide its curve
  assert [r["optimizer"] for r in rep["rows"]] == [
    "Adam (tuned, lr=0.01)",
    "Muon (tuned, lr=0.02)",
    "SOAP (tuned, lr=0.003)",
    "kfac",
    "sgd",
  ]
  assert rep["grids"]["soap"] == [(0.01, 6.5), (0.003, 4.5)]
  # SOAP's loss 5 comes after 2 steps of 3 s; Adam's after 3 of 2 s (its first as a typical one).
  assert runs[7].summary["time_to_target"] == (2, 6.0) and runs[7].summary["vs_adam"] == 1.0
  assert rep["grids"]["muon"][1][0] == 0.05 and math.isnan(rep["grids"]["muon"][1][1])
  table = _harness.race_table(
    rep["rows"] + [{"optimizer": "up", "error": "ValueError: a | b"}], 10.0, rep["target"]
  )
  lines = table.splitlines()
  assert lines[0] == (
    "| contestant | loss at 10 s | seconds to 5 | vs Adam | steps | mean step (ms) | compile (s) |"
  )
  assert lines[2] == "| Adam (tuned, lr=0.01) | 5.5 | 6.0 | 1.00x | 4 | 2000.0 | 1.00 |"
  assert lines[4] == "| SOAP (tuned, lr=0.003) | 4.5 | 6.0 | 1.00x | 4 | 3000.0 | 1.00 |"
  assert lines[5] == "| kfac | 2.5 | 3.0 | 0.50x | 4 | 3000.0 | 1.00 |"
  assert lines[6] == "| sgd | 8 | not reached |  | 4 | 1000.0 | 1.00 |"
  assert lines[7].startswith("| up | failed: ValueError: a / b |")
  with pytest.raises(ValueError, match="needs at least one Adam run"):
    _harness.race_compare(runs[2:], reach_window=5)


def test_race_table_reports_extra_evaluations_against_the_tuned_adam():
  rows = [
    dict(_race_run("Adam", "adam", [2, 1], [1, 1], 1.0).summary, extra_eval={"se": 8.0}),
    dict(_race_run("kfac", "kfac", [2, 1], [1, 1], 0.9).summary, extra_eval={"se": 2.0}),
    _race_run("sgd", "sgd", [2, 1], [1, 1], 1.5).summary,
    {"optimizer": "up", "error": "boom"},
  ]
  lines = _harness.race_table(rows, 10.0, 1.0).splitlines()
  assert lines[0].endswith("| compile (s) | se at 10 s (vs Adam) |"), lines[0]
  assert lines[1].count("|") == 9
  assert lines[2].endswith("| 8 (1.00x) |") and lines[3].endswith("| 2 (0.25x) |"), lines
  assert lines[4].endswith("| 1.00 |  |") and lines[5].count("|") == 9, lines


_RACE_CONFIG = "0.3:0.7:0.1:0.01:dense=ekfac"
_RACE_BUDGET = 0.25  # charged seconds per contestant


def test_race_contestants_by_default(monkeypatch, tmp_path):
  """The race's full contestant list, built (not run): the Adam and Muon grids, SGD, the
  transform plain, with KL clipping, with each `--kfac-configs` entry and on EKFAC, and the
  Optimizer. (`test_race_quick` runs a shorter list: every kind of contestant once.)"""
  from benchmarks import race

  monkeypatch.setenv("KFAC_DATA_DIR", str(tmp_path))
  args, wl, _ = race.parse_args(
    ["--workload", "autoencoder", "--quick", "--encoder", "8,4", "--adam-lrs", "1e-3,3e-3"]
    + ["--kfac-configs", "0.3:0.7:0.1:0.01", "--max-norm", "0.5", "--plot", ""]
  )
  workload = race.autoencoder.make_workload(wl)
  contestants = race.race_contestants(workload, args, wl)
  assert [c.name for c in contestants] == [
    "Adam lr=0.001",
    "Adam lr=0.003",
    "Muon lr=0.02",
    "Muon lr=0.05",
    "SGD+momentum",
    "kfac_jax (optax), statistics every 5",
    "kfac_jax (optax), max_norm=0.5",
    "kfac_jax (optax) 0.3:0.7:0.1:0.01",
    "kfac_jax (optax), EKFAC",
    "kfac_jax Optimizer",
  ]
  hyper = {c.name: c.hyperparameters for c in contestants}
  # The race's own row is `kfac` on its defaults with the README's learning rate (KFAC_DEFAULTS).
  own = hyper["kfac_jax (optax), statistics every 5"]
  assert (own["learning_rate"], own["momentum"], own["damping"]) == (1.0, 0.7, 0.1)
  assert (own["inverse_every"], own["curvature_every"]) == (5, 5)
  assert hyper["kfac_jax (optax), max_norm=0.5"]["max_norm"] == "0.5"
  assert "'dense': 'ekfac', 'conv': 'ekfac'" in hyper["kfac_jax (optax), EKFAC"]["layers"]
  assert hyper["kfac_jax (optax) 0.3:0.7:0.1:0.01"]["max_norm"] == "0.01"
  assert workload.description.startswith("64-8-4-8-64 autoencoder"), workload.description


def test_race_learning_rate_decay_reaches_zero_for_adam_and_kfac(monkeypatch, tmp_path):
  """`--adam-decay-steps N` adds Adam over its grid on a cosine schedule (its own family, so the
  constant-rate tuned Adam stays the reference); `decay_steps=N` puts a `kfac` entry on one.
  With N = 1 the rate is 0 from the second step: without momentum the parameters stop moving."""
  from benchmarks import race

  monkeypatch.setenv("KFAC_DATA_DIR", str(tmp_path))
  args, wl, _ = race.parse_args(
    ["--workload", "autoencoder", "--quick", "--encoder", "8,4", "--adam-lrs", "1e-3"]
    + ["--muon-lrs", "", "--no-sgd", "--no-ekfac", "--no-optimizer", "--plot", ""]
    + ["--adam-decay-steps", "1", "--kfac-configs", "0.3:0:0.1:0:decay_steps=1"]
  )
  workload = race.autoencoder.make_workload(wl)
  contestants = {c.name: c for c in race.race_contestants(workload, args, wl)}
  decayed = [
    contestants["Adam lr=0.001, cosine to 0 over 1 steps"],
    contestants["kfac_jax (optax) 0.3:0:0.1:0:decay_steps=1"],
  ]
  assert decayed[0].family == "adam_decay" and decayed[1].hyperparameters["decay_steps"] == 1
  batch = jax.tree.map(jnp.asarray, workload.batch_at(0))
  rng = jax.random.key(0)
  for c in [*decayed, contestants["Adam lr=0.001"]]:
    step = jax.jit(c.step)  # Eager, each of the step's ops would compile on its own.
    params, state = workload.params0, jax.jit(c.init)(workload.params0)
    params1, state, _ = step(params, state, batch, rng)
    params2, state, _ = step(params1, state, batch, rng)
    moved = [
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params1))
    ]
    assert max(moved) > 0, c.name
    still = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.array_equal(a, b), params1, params2))
    assert all(still) == (c.family != "adam"), c.name


def test_race_soap_grid_builds_soap_contestants(monkeypatch, tmp_path, capsys):
  """`--soap-lrs` adds SOAP (`benchmarks/soap.py`) over its grid as the "soap" family with
  `--soap-every` as its refresh period; its first step only builds the bases (no move), its
  second moves every parameter. `--soap-every 0` is refused."""
  from benchmarks import race

  monkeypatch.setenv("KFAC_DATA_DIR", str(tmp_path))
  flags = ["--workload", "autoencoder", "--quick", "--encoder", "8,4", "--adam-lrs", "1e-3"]
  flags += ["--muon-lrs", "", "--no-sgd", "--no-ekfac", "--no-optimizer", "--plot", ""]
  args, wl, _ = race.parse_args(flags + ["--soap-lrs", "3e-3,1e-2", "--soap-every", "5"])
  workload = race.autoencoder.make_workload(wl)
  soaps = [c for c in race.race_contestants(workload, args, wl) if c.family == "soap"]
  assert [c.name for c in soaps] == ["SOAP lr=0.003", "SOAP lr=0.01"]
  assert soaps[0].hyperparameters == {"learning_rate": 3e-3, "precondition_every": 5}
  batch = jax.tree.map(jnp.asarray, workload.batch_at(0))
  step = jax.jit(soaps[1].step)  # Eager, each of the step's ops would compile on its own.
  params0, state = workload.params0, jax.jit(soaps[1].init)(workload.params0)
  params1, state, _ = step(params0, state, batch, jax.random.key(0))
  params2, state, _ = step(params1, state, batch, jax.random.key(0))
  assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, params0, params1)))
  assert not any(jax.tree.leaves(jax.tree.map(jnp.array_equal, params1, params2)))
  with pytest.raises(SystemExit):
    race.parse_args(flags + ["--soap-every", "0"])
  assert "--soap-every must be >= 1, got 0" in capsys.readouterr().err


def test_race_seeds_summary_matches_grid_rows_by_family_and_counts_wins():
  """`race_seeds.summarise`: the tuned Adam row of each seed (whatever its learning rate) is
  the reference of that seed; ratios, means and seeds ahead per contestant; a contestant that
  missed the target or failed in a seed leaves a gap, not a zero."""
  from benchmarks import race_seeds

  def row(name, fam, loss, vs):
    return {"optimizer": name, "family": fam, "final_eval_loss": loss, "vs_adam": vs}

  per_seed = {
    0: [row("Adam (tuned, lr=0.002)", "adam", 0.30, 1.0), row("kfac", "kfac", 0.27, 0.6)],
    1: [row("Adam (tuned, lr=0.001)", "adam", 0.20, 1.0), row("kfac", "kfac", 0.22, None)],
    2: [
      row("Adam (tuned, lr=0.002)", "adam", 0.25, 1.0),
      {"optimizer": "kfac", "family": "kfac", "error": "failed"},
    ],
  }
  rows = {r["optimizer"]: r for r in race_seeds.summarise(per_seed)}
  assert list(rows) == ["Adam (tuned)", "kfac"]
  k = rows["kfac"]
  assert k["vs_adam"] == [0.6, None, None]
  np.testing.assert_allclose(k["loss_ratio"][:2], [0.9, 1.1])
  assert k["loss_ratio"][2] is None
  assert k["mean_vs_adam"] == 0.6 and k["ahead"] == 1 and k["seeds_with_loss"] == 2
  np.testing.assert_allclose(k["mean_loss_ratio"], 1.0)
  assert rows["Adam (tuned)"]["loss_ratio"] == [1.0, 1.0, 1.0]
  table = race_seeds.table(list(rows.values()), [0, 1, 2])
  assert "| kfac | 0.60x, 0.900 | not reachedx, 1.100 |" not in table  # no stray suffix
  assert (
    "| kfac | 0.60x, 0.900 | not reached, 1.100 | not reached, - | 0.60 | 1.000 | 1 of 2 |" in table
  )


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--seeds", "0"], "at least two distinct seeds"),
    (["--seeds", "0,x"], "comma-separated integers"),
    (["--seeds", "0,1", "--workload", "cnn", "--seed", "3"], "not --seed"),
    (["--seeds", "0,1", "--workload", "cnn", "--json", "a.json"], "--json-prefix"),
  ],
)
def test_race_seeds_arguments(argv, match, capsys):
  from benchmarks import race_seeds

  with pytest.raises(SystemExit):
    race_seeds.main(argv)
  assert match in capsys.readouterr().err


def test_race_quick(tmp_path, monkeypatch, capsys):
  """A short race: every kind of contestant once (the full default list is checked above), on
  a 64-16-4-16-64 autoencoder, where compilation is most of the time. In this process: a
  subprocess would pay the imports and JAX's start-up again."""
  from benchmarks import race

  out_json, out_png = tmp_path / "race.json", tmp_path / "race.png"
  stdout, output = _scripts.run_main(
    race.main,
    [
      "--workload",
      "autoencoder",
      "--quick",
      "--encoder",
      "16,4",
      "--budget",
      str(_RACE_BUDGET),
      "--adam-lrs",
      "1e-3",
      "--muon-lrs",
      "0.02",
      "--soap-lrs",
      "1e-2",
      "--no-sgd",
      "--no-ekfac",
      "--kfac-configs",
      _RACE_CONFIG,
      "--json",
      str(out_json),
      "--plot",
      str(out_png),
    ],
    tmp_path,
    monkeypatch,
    capsys,
  )
  assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with open(out_json) as f:
    report = json.load(f)
  names = [r["optimizer"] for r in report["results"]]
  assert names[0].startswith("Adam (tuned, lr=") and names[1] == "Muon (tuned, lr=0.02)", names
  own = "kfac_jax (optax), statistics every 5"  # `kfac`'s defaults (race.KFAC_DEFAULTS)
  assert names[2:] == [
    "SOAP (tuned, lr=0.01)",
    own,
    f"kfac_jax (optax) {_RACE_CONFIG}",
    "kfac_jax Optimizer",
  ], names
  layers = report["hyperparameters"][f"kfac_jax (optax) {_RACE_CONFIG}"]["layers"]
  assert "'dense': 'ekfac'" in layers, layers
  for r in report["results"]:
    assert r["steps"] >= 2 and r["charged_s"] >= _RACE_BUDGET, r
    assert math.isfinite(r["final_eval_loss"]), r
    assert (
      len(
        report["curves"][
          r["optimizer"]
          if r["family"] not in _harness.GRID_FAMILIES
          else next(
            x["optimizer"]
            for x in report["all_runs"]
            if x["family"] == r["family"] and x["final_eval_loss"] == r["final_eval_loss"]
          )
        ]["losses"]
      )
      == r["steps"]
    )
    assert re.search(rf"^\| {re.escape(r['optimizer'])} \| [0-9.]+ \|", stdout, re.MULTILINE), (
      output
    )
  assert report["budget_s"] == _RACE_BUDGET
  assert f"--budget {_RACE_BUDGET}" in report["env"]["command"], report["env"]["command"]
  # The autoencoder's squared reconstruction error: a column, with the ratio to the tuned Adam.
  assert f"| squared error at {_RACE_BUDGET:g} s (vs Adam) |" in stdout, output
  errors = [r["extra_eval"]["squared error"] for r in report["results"]]
  assert all(math.isfinite(e) and e > 0 for e in errors), errors
  assert f"{errors[0]:.4g} (1.00x) |" in stdout, output


def test_step_sweep_quick(tmp_path, monkeypatch, capsys):
  """benchmarks/step_sweep.py: one table row per Adam learning rate and per kfac setting (on a
  64-16-4-16-64 autoencoder, in this process)."""
  from benchmarks import step_sweep

  stdout, output = _scripts.run_main(
    step_sweep.main,
    ["--workload", "autoencoder", "--quick", "--encoder", "16,4", "--steps", "3"]
    + [
      "--adam-lrs",
      "1e-3",
      "--configs",
      "defaults,0.3:0.7:0.1:0.3:stats_batch=8",
    ],
    tmp_path,
    monkeypatch,
    capsys,
  )
  assert "64-16-4-16-64 autoencoder" in stdout, output
  assert "| eval loss | squared error |" in stdout, output
  # `defaults` and one explicit entry (the entries' parsing: test_kfac_config_parser).
  for name in (
    "Adam lr=0.001",
    "kfac defaults",
    "kfac 0.3:0.7:0.1:0.3:stats_batch=8",  # Statistics from 8 of the batch's rows.
  ):
    row = re.search(
      rf"^\| {re.escape(name)} \| ([0-9.e+]+) \| ([0-9.e+]+) \|$", stdout, re.MULTILINE
    )
    assert row is not None and math.isfinite(float(row.group(1))), output
    assert 0 < float(row.group(2)) < float(row.group(1)), output  # Pinsker: SE <= CE / 2.


def test_autoencoder_squared_error_is_the_mean_over_images_of_the_pixel_sum():
  from examples import autoencoder as ae

  model = ae.make_model(6, (3, 2))
  params = ae.init_params(model, 0)
  images = np.random.default_rng(0).uniform(size=(5, 6)).astype(np.float32)
  probs = jax.jit(lambda p, x: jax.nn.sigmoid(model.apply(p, x)))(params, jnp.asarray(images))
  want = np.mean(np.sum((np.asarray(probs) - images) ** 2, -1))
  assert ae.make_squared_error_fn(model, images, chunk=2)(params) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("model", ["vit", "rnn"])
def test_family_workloads_register_every_layer(model, monkeypatch):
  """benchmarks/families.py: the ViT and the LSTM register with no fallback (strict), and the
  workload's batches and evaluation are those of Fashion-MNIST (installed by the test setup;
  the ViT's 7x7 patches need its 28x28 images)."""
  import kfac_jax
  from benchmarks import families

  monkeypatch.delenv("KFAC_DATA_DIR")  # The installed data, not the digits fallback.

  args = getattr(families, model.upper()).parse_args(["--quick"])
  wl = families.make_workload(args)
  batch = jax.tree.map(jnp.asarray, wl.batch_at(0))
  assert batch["x"].shape[0] == 32 and batch["y"].shape == (32,)
  layers = kfac_jax.Registration(wl.loss_fn, wl.params0, batch, strict=True).layers
  kinds = sorted({l.kind for l in layers})
  assert kinds == (["dense", "scale_and_shift"] if model == "vit" else ["dense"]), layers
  assert math.isfinite(wl.eval_fn(wl.params0))


def test_family_flags_are_named(capsys):
  from benchmarks import families

  with pytest.raises(SystemExit):
    families.parse_args(["--model", "vit", "--width", "10", "--heads", "4"])
  assert "--width 10 must be a multiple of --heads 4" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    families.RNN.parse_args(["--with-upstream"])
  assert "no upstream kfac-jax version" in capsys.readouterr().err


def test_command_line_starts_with_the_timing_environment(monkeypatch):
  """A recorded command reproduces the run: the thread settings that change CPU step times
  come first when set, and not otherwise."""
  for k in _harness.TIMING_ENV:
    monkeypatch.delenv(k, raising=False)
  assert _harness.command_line("benchmarks/race.py", ["--budget", "30"]).startswith("python ")
  monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
  monkeypatch.setenv("XLA_FLAGS", "--a --b")
  cmd = _harness.command_line("benchmarks/race.py", ["--budget", "30"])
  assert cmd.startswith("OPENBLAS_NUM_THREADS=1 XLA_FLAGS='--a --b' python "), cmd
  assert cmd.endswith("race.py --budget 30"), cmd


def test_kfac_config_parser():
  """`--kfac-configs` entries: four numbers, then optional named settings; bad ones name
  themselves."""
  from benchmarks import race

  assert race.parse_kfac_config("0.3:0.7:0.1:0") == {
    "learning_rate": 0.3,
    "momentum": 0.7,
    "damping": 0.1,
    "max_norm": None,  # Clipping off, not kfac's default.
  }
  assert race.parse_kfac_config("0.3:0.7:0.1:0.3:stats_batch=64")["stats_batch"] == 64
  cfg = race.parse_kfac_config("0.3:0.7:0.1:0.3:statistics_fraction=0.25")
  assert cfg["statistics_fraction"] == 0.25
  cfg = race.parse_kfac_config("0.3:0.7:0.1:0.3:statistics_fraction=auto")
  assert cfg["statistics_fraction"] == "auto"
  assert race.parse_kfac_config("0.3:0.7:0.1:0.3:decay_steps=100")["decay_steps"] == 100
  assert race.parse_kfac_config("0.3:0.7:0.1:0.3:factor_solve=never")["factor_solve"] == "never"
  cfg = race.parse_kfac_config("0.3:0.7:0.1:0.3:preconditioner_dtype=bfloat16")
  assert cfg["preconditioner_dtype"] == "bfloat16"
  cfg = race.parse_kfac_config(
    "1:0.7:0.03:0.3:ema_decay=0.99:estimation_mode=curvature_prop:num_samples=2"
  )
  assert (cfg["ema_decay"], cfg["estimation_mode"], cfg["num_samples"]) == (
    0.99,
    "curvature_prop",
    2,
  )
  cfg = race.parse_kfac_config("1:0:0.1:0.01:curvature_every=5:inverse_every=10:conv=kron_sua")
  layers = cfg.pop("layers")
  assert cfg == {
    "learning_rate": 1.0,
    "momentum": 0.0,
    "damping": 0.1,
    "max_norm": 0.01,
    "curvature_every": 5,
    "inverse_every": 10,
  }
  assert dict(layers.defaults) == {"conv": "kron_sua"}
  for bad, match in [
    ("0.3:0.7:0.1", "lr:momentum:damping:clip"),
    ("0.3:0.7:0:0", "damping > 0"),
    ("0.3:0.7:0.1:0:every=5", "unknown setting 'every=5'"),
    ("0.3:0.7:0.1:0:curvature_every=x", "curvature_every must be an int, got 'x'"),
    ("0.3:0.7:0.1:0:inverse_every=0", "inverse_every must be >= 1"),
    ("0.3:0.7:0.1:0:decay_steps=0", "decay_steps must be >= 1"),
    ("0.3:0.7:0.1:0:statistics_fraction=2", "statistics_fraction must be in (0, 1]"),
    ("0.3:0.7:0.1:0:statistics_fraction=x", "statistics_fraction must be a number, got 'x'"),
    ("0.3:0.7:0.1:0:factor_solve=yes", "factor_solve must be auto, always or never, got 'yes'"),
    ("0.3:0.7:0.1:0:preconditioner_dtype=f16", "must be bfloat16 or float32, got 'f16'"),
    ("0.3:0.7:0.1:0:ema_decay=1", "ema_decay must be in (0, 1), got '1'"),
    ("0.3:0.7:0.1:0:estimation_mode=fisher", "estimation_mode must be one of gradients,"),
    ("0.3:0.7:0.1:0:num_samples=0", "num_samples must be >= 1"),
  ]:
    with pytest.raises(ValueError, match=re.escape(match)):
      race.parse_kfac_config(bad)


def test_zoo_defaults_smoke(capsys):
  """benchmarks/zoo_defaults.py trains a zoo model on `kfac`'s defaults and reports the ratio."""
  from benchmarks import zoo_defaults

  assert zoo_defaults.main(["--steps", "3", "--lrs", "0.3", "--models", "vae"]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| vae |")]
  assert len(rows) == 1, out
  for row in rows:
    ratio = float(row.split("|")[2].split()[0])
    assert 0 < ratio < 1, row
  assert "diverged: none" in out
  with pytest.raises(SystemExit):
    zoo_defaults.main(["--models", "no_such_model"])


def test_zoo_statistics_rows_smoke(capsys):
  """benchmarks/zoo_statistics_rows.py: at 256 rows `kfac`'s default cuts an MLP's batch,
  equal to the explicit quarter, and says so (one flavour: the rows cut are the batch's, the
  same for both)."""
  from benchmarks import zoo_statistics_rows

  assert zoo_statistics_rows.main(["--models", "mlp:linen"]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| mlp (")]
  assert len(rows) == 1 and "| mlp (linen) | cut | True | ran |" in rows[0], out
  assert "1 cut, 0 whole, 0 neither; bad: none" in out
  with pytest.raises(SystemExit):
    zoo_statistics_rows.main(["--models", "no_such_model"])


def test_accumulation_profile_quick(capsys):
  """`profile/accumulation.py` on the autoencoder's small model: the four rows, and each
  optimizer reaches the same loss in `MultiSteps` and accumulated in the step (the two forms
  make the same updates; times not asserted)."""
  from benchmarks.profile import accumulation

  argv = ["--workload", "autoencoder", "--micro", "2", "--periods", "1", "--encoder", "16,4"]
  assert accumulation.main(argv + ["--batch", "64"]) == 0
  out = capsys.readouterr().out
  rows = re.findall(
    r"^(.+?) +[0-9.]+ ms per micro-batch +loss after 3 updates ([0-9.]+)$", out, re.M
  )
  names = [r[0] for r in rows]
  assert names == [
    "Adam in MultiSteps",
    "Adam, accumulated in the step",
    "kfac in MultiSteps",
    "kfac, accumulated in the step",
  ], out
  loss = [float(r[1]) for r in rows]
  assert loss[0] == pytest.approx(loss[1], rel=1e-4) and loss[2] == pytest.approx(loss[3], rel=1e-4)
  assert loss[2] != loss[0], out  # K-FAC's updates are not Adam's.


def test_preconditioner_dtype_profile_quick(capsys):
  """`profile/preconditioner_dtype.py` on the CNN's small model: both dtypes timed, the
  bfloat16 cache smaller, the bfloat16 update close to the float32 one (times not asserted)."""
  from benchmarks.profile import preconditioner_dtype

  argv = ["--workload", "cnn", "--quick", "--repeats", "1", "--rounds", "1"]
  assert preconditioner_dtype.main(argv) == 0
  out = capsys.readouterr().out
  rows = re.findall(r"^\| (float32|bfloat16) \| 1 \| [0-9.]+ \| ([0-9,]+) \|$", out, re.M)
  assert [r[0] for r in rows] == ["float32", "bfloat16"], out
  assert int(rows[1][1].replace(",", "")) < int(rows[0][1].replace(",", "")), out
  cos = re.search(r"cosine between the two updates ([0-9.]+)$", out, re.M)
  assert cos is not None and float(cos.group(1)) > 0.99, out


def test_adaptive_damping_prototype_quick(tmp_path, monkeypatch, capsys):
  """`profile/adaptive_damping.py` on the autoencoder's small model: the three rows with steps
  and finite losses, the first adaptation (update 1 of period 1: the second step, which every
  budget runs) traced; the rule raises λ below ρ = 1/8, lowers it above 3/8, keeps it between,
  and stays in its bounds."""
  from benchmarks.profile import adaptive_damping as ad

  w = 0.5
  got = [float(ad.adapt(jnp.float32(1.0), jnp.float32(r), w)) for r in (-1.0, 0.2, 0.9)]
  assert got == [2.0, 1.0, 0.5]
  assert float(ad.adapt(jnp.float32(8.0), jnp.float32(0.0), w)) == ad.LAMBDA_MAX
  assert float(ad.adapt(jnp.float32(1.5e-4), jnp.float32(1.0), w)) == pytest.approx(ad.LAMBDA_MIN)
  argv = ["--budget", "0.5", "--period", "1", "--trace", "--quick"]
  out, _ = _scripts.run_main(ad.main, argv, tmp_path, monkeypatch, capsys)
  rows = re.findall(
    r"^\| (Adam|kfac, [^|]*) \| (\d+) \| ([0-9.e+-]+) \| ([0-9.e+-]+) \|$", out, re.M
  )
  assert [r[0] for r in rows] == ["Adam", "kfac, λ 0.03", "kfac, damping adapted every 1 from 0.1"]
  assert all(int(r[1]) > 0 and np.isfinite(float(r[2])) and np.isfinite(float(r[3])) for r in rows)
  assert re.search(r"^update 1: rho -?[0-9.]+, damping [0-9.e+-]+$", out, re.M), out


def test_step_timeline_profile_quick(capsys):
  """`profile/step_timeline.py` on the autoencoder's small model: the traced inverse update's
  thunks are attributed to K-FAC's statistics, inverses and products and to the model's pass
  (times not asserted, only that each part was found)."""
  from benchmarks.profile import step_timeline

  argv = ["--workload", "autoencoder", "--quick", "--phase", "inverses", "--top", "3"]
  argv += ["--curvature-every", "2", "--inverse-every", "2"]
  assert step_timeline.main(argv) == 0
  out = capsys.readouterr().out
  parts = dict(re.findall(r"^\| ([A-Za-z -]+) \| ([0-9.]+) \| [0-9.]+ \| [0-9]+% \|$", out, re.M))
  assert set(parts) == {name for name, _ in step_timeline.PARTS} | {"other"}, out
  for name, _ in step_timeline.PARTS:
    assert float(parts[name]) > 0, (name, out)
  assert "(statistics + inverses)" in out, out
  assert len(re.findall(r"^\| \S+ \| [0-9.]+ \| `", out, re.M)) == 3, out


def test_step_timeline_attributes_thunks_by_op_name():
  """The trace parsing on hand-made events: an asynchronous thunk runs to its end marker,
  control-flow thunks are not counted twice, names map to parts by op_name."""
  from benchmarks.profile import step_timeline

  hlo = (
    '  %dot.3 = f32[4,4]{1,0} dot(%a, %b), metadata={op_name="jit(step)/transpose(jvp(M))/d"}\n'
    '  %ynn_fusion.1 = f32[4]{0} fusion(%c), metadata={op_name="jit(step)/kfac_multiply_'
    'matpower/dot_general"}\n'
    '  %cond.2 = (f32[4]) conditional(%p), metadata={op_name="jit(step)/cond"}\n'
  )
  info = step_timeline.thunk_info(hlo)
  assert info["dot.3"] == ("f32[4,4]{1,0}", "jit(step)/transpose(jvp(M))/d")
  assert step_timeline.part_of(info["dot.3"][1]) == "forward and backward"
  assert step_timeline.part_of(info["ynn_fusion.1"][1]) == "K-FAC products"
  events = [
    {"ph": "X", "name": "dot.3", "ts": 0.0, "dur": 1.0},
    {"ph": "i", "name": "end: dot.3", "ts": 9.0},
    {"ph": "X", "name": "ynn_fusion.1", "ts": 10.0, "dur": 5.0},
    {"ph": "X", "name": "cond.2", "ts": 9.0, "dur": 7.0},
    {"ph": "X", "name": "ThunkExecutor::Execute", "ts": 0.0, "dur": 20.0},
  ]
  spans = step_timeline.busy_intervals(events, info)
  assert spans == [("dot.3", 0.0, 9.0), ("ynn_fusion.1", 10.0, 15.0)]
  assert step_timeline.union_ms([(0, 4000), (2000, 5000), (7000, 8000)]) == 6.0


def test_factor_solve_profile_quick(capsys):
  """`profile/factor_solve.py` on one small factor: both forms timed, the substitution solve
  correct (its residual is printed; times are not asserted)."""
  from benchmarks.profile import factor_solve

  argv = ["--sizes", "300x4,40x4", "--workload", "none", "--repeats", "2"]
  assert factor_solve.main(argv) == 0
  out = capsys.readouterr().out
  rows = re.findall(r"^\| (\d+) \| (\d+) \|.*\| ([0-9.e+-]+) \|$", out, re.M)
  assert [(r[0], r[1]) for r in rows] == [("300", "4"), ("40", "4")], out
  assert all(float(r[2]) < 1e-3 for r in rows), out


def test_conv_in_cond_profile_quick(capsys):
  """`profile/conv_in_cond.py` part 1 on a batch of 4 (the timings' subject is the kernel
  order, not the size): every convolution form timed inside and outside a cond (times are
  printed, not asserted)."""
  from benchmarks.profile import conv_in_cond

  assert conv_in_cond.main(["--no-workload", "--repeats", "1", "--batch", "4"]) == 0
  out = capsys.readouterr().out
  assert "| one 3×3 convolution, 4 × 14 × 14 × 16 → 32 |" in out, out
  rows = re.findall(r"^\| ([a-z][^|]*) \| [0-9.]+ \| [0-9.]+ \|$", out, re.M)
  assert len(rows) == 5 and rows[2].startswith("pull-back to the input"), out
