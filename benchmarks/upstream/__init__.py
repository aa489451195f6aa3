"""DeepMind kfac-jax 0.0.8 as a benchmark contestant (own venv, subprocess)."""
