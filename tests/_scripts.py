"""Running a script's `main(argv)` inside the test process (examples and benchmarks)."""


def run_main(main, argv, tmp_path, monkeypatch, capsys):
  """`main(argv)` in `tmp_path`, with KFAC_DATA_DIR pointed at an empty directory (the small
  scikit-learn digits fallback) and matplotlib on Agg; asserts it returns 0 and returns
  (stdout, stdout + stderr). Without a subprocess there is no second interpreter's imports
  and JAX start-up to pay."""
  empty = tmp_path / "no_data"
  empty.mkdir(exist_ok=True)
  monkeypatch.setenv("KFAC_DATA_DIR", str(empty))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  status = main(argv)
  captured = capsys.readouterr()
  output = captured.out + captured.err
  assert status == 0, output
  return captured.out, output
