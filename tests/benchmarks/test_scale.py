"""`benchmarks/scale.py --quick` and its cost model: the report's structure, not its timings."""

import json
import math

import pytest

from benchmarks import cost_model as cm

COMPONENTS = ("forward_backward", "statistics", "refresh", "preconditioning", "adamw_update")
STEPS = ("adamw_step", "kfac_plain_step", "kfac_amortised_step")


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_scale_quick(tmp_path, monkeypatch, capsys):
  """`scale.py --quick --race`, its `main` in this process (no second interpreter's imports
  and JAX start-up to pay)."""
  from benchmarks import scale

  out = tmp_path / "scale.json"
  monkeypatch.chdir(tmp_path)
  assert scale.main(["--quick", "--race", "--json", str(out)]) == 0
  stdout = capsys.readouterr().out
  report = json.loads(out.read_text())
  assert "--quick" in report["env"]["command"]
  (row,) = report["measurements"]
  for k in COMPONENTS + STEPS:
    assert _positive(row["seconds"][k]), (k, row["seconds"])
  assert set(row["kfac_phases_s"]) == {"plain", "statistics", "both"}
  assert 0 <= row["state_bytes"]["adamw"] - 2 * row["state_bytes"]["params"] < 64  # m, v, count
  assert row["state_bytes"]["kfac"] > row["state_bytes"]["params"]
  # The cost model's factor layout is the registration's.
  assert row["factors"]["registered"] == row["factors"]["cost_model"]
  model = report["cost_model"]
  assert all(_positive(v) for v in model["machine"].values()), model["machine"]
  calibration = report["calibration"]
  assert _positive(calibration["draw"]) and _positive(calibration["product"]), calibration
  assert model["machine"]["product"] == calibration["product"]
  for errors in model["errors"].values():
    assert set(errors) == set(COMPONENTS + STEPS)
    assert all(math.isfinite(e) and e > -1 for e in errors.values()), errors
  large = model["predictions"]["large"]
  assert large["shape"]["d"] == 4096 and large["shape"]["tokens"] == 2**20
  assert all(_positive(v) for v in large["seconds"].values()), large["seconds"]
  assert _positive(large["state_over_params"]["kfac"])
  race = report["race"]
  assert _positive(race["adamw_seconds"]) and math.isfinite(race["target"])
  assert len(race["runs"]["K-FAC"]["losses"]) >= 1
  assert "| d | params | fwd+bwd |" in stdout


def test_cost_model_counts():
  """FLOPs of the components against hand counts on a small shape."""
  shape = cm.ModelShape(d=64, layers=2, vocab=1000, seq=8, batch=4, ff=128)
  sched = cm.Schedule(curvature_every=1, inverse_every=1, statistics_fraction=0.5)
  assert cm.swiglu_width(4096) == 11008
  per_layer = 4 * 64 * 64 + 3 * 64 * 128
  assert shape.matmul_params == 2 * per_layer + 64 * 1000
  c = cm.components(shape, sched)
  T = 32
  assert c["forward_backward"].flops == 6 * shape.matmul_params * T + 12 * 2 * 4 * 8 * 8 * 64
  # Refresh: q, k, v, o (2 sides of 64), gate, up (64, 128), down (128, 64) per layer; the
  # head's 64 and 1000 (<= max_factor_dim: whole); the embedding's diagonal 1000 and 64; five
  # RMSNorm blocks of 64.
  cubes = 2 * (8 * 64**3 + 3 * (64**3 + 128**3)) + 64**3 + 1000**3 + 1000 + 64**3 + 5 * 64**3
  assert c["refresh"].flops == cubes
  blocked = cm.components(shape, cm.Schedule(block_size=32, max_factor_dim=500))
  # Every side wider than 32 in blocks of 32; the head's 1000 > 500 a diagonal.
  sides = cm.factor_sides(shape, cm.Schedule(block_size=32, max_factor_dim=500))
  assert all(x.w in (1, 32) for x in sides)
  assert blocked["refresh"].flops == sum(x.n * x.w**2 * x.count for x in sides)
  machine = cm.Machine(1e10, 1e9, 1e10, math.inf, 1e10)
  pred = cm.predict(shape, sched, machine)
  assert pred["ratio_amortised"] > pred["ratio_plain"] > 1
  # The products at their own calibrated rate: twice the rate, half their FLOPs' seconds.
  faster = cm.predict(shape, sched, cm.Machine(1e10, 1e9, 1e10, math.inf, 2e10))
  pre = c["preconditioning"]
  assert pred["preconditioning"] - faster["preconditioning"] == pytest.approx(pre.flops / 2e10)
  assert faster["forward_backward"] == pred["forward_backward"]
  # The calibration products are the model's: their FLOPs and the embedding's elementwise
  # product with its diagonal A side make the preconditioning's (sides that the blocks divide).
  for s in (sched, cm.Schedule(block_size=32, max_factor_dim=500)):
    shapes = cm.product_shapes(shape, s)
    flops = sum(2 * c * k * m * w * n for c, k, m, w, n in shapes)
    pre = cm.components(shape, s)["preconditioning"].flops
    diagonal = 2 * 64 * 1000 if s.max_factor_dim == 500 else 0  # The head's V side.
    assert flops + 1000 * 64 + diagonal == pre, (s, shapes)
  # The embedding's [V, d] gradient against its G side, whole or in blocks of 32.
  assert (1, 1, 1000, 64, 64) in cm.product_shapes(shape, sched)
  assert (1, 2, 1000, 32, 32) in cm.product_shapes(shape, cm.Schedule(block_size=32))
  # Statistics from whole sequences: 0.1 of 4 is one sequence, a quarter of the tokens.
  quarter = cm.Schedule(statistics_fraction=0.1)
  assert cm.statistics_rows(shape, quarter) == 1
  assert cm.components(shape, quarter)["statistics"].draws == 8 * 1000


def test_cost_model_fit_recovers_constants():
  """Times made by the model from known constants give those constants back."""
  machine = cm.Machine(5e10, 2e10, 8e9, 3e7, 9e10)
  sched = cm.Schedule()
  rows = []
  for d in (256, 512):
    shape = cm.ModelShape(d=d, layers=2, vocab=4096, seq=64, batch=4)
    rows.append({"shape": shape, "schedule": sched, "seconds": cm.predict(shape, sched, machine)})
  fitted = cm.fit(rows, cm.Calibration(machine.draw, machine.product))
  assert fitted.matmul == pytest.approx(machine.matmul, rel=1e-9)
  assert fitted.factor == pytest.approx(machine.factor, rel=1e-9)
  assert fitted.bandwidth == pytest.approx(machine.bandwidth, rel=1e-9)
  assert fitted.draw == machine.draw and fitted.product == machine.product
  assert cm.growth_exponent([1, 2, 4], [3, 24, 192]) == pytest.approx(3.0)
