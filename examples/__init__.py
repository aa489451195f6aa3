"""Examples (and the benchmarks, which import them).

Importing this package turns off XLA's concurrency-optimised CPU scheduler, unless `XLA_FLAGS`
already mentions it: with jaxlib 0.10.2 on the 2-core development machine, the first K-FAC step
of the Transformer LM benchmark (`benchmarks/transformer.py`: 2 blocks, d=64) never returned,
every thread idle, while `--xla_cpu_enable_concurrency_optimized_scheduler=false` runs it normally
(see README, Troubleshooting). The flag is read when JAX creates its CPU client, so it only
takes effect if nothing has run on the CPU yet; scripts import this package first.
"""

import os

_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=false").strip()
