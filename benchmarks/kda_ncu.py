"""One forward+backward of our KDA at B1 T16384 H32 K128 (bf16), for Nsight Compute:

  ncu --clock-control none -k regex:kda_ python3 benchmarks/kda_ncu.py ours

The call runs twice (the first compiles); the profiler's kernel filter and launch count pick
what it reads. Inputs as in ``benchmarks/kda.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kda as bench  # noqa: E402


def main(which: str, shape=(1, 16384, 32, 128)):
  if which != "ours":  # jla's Mosaic GPU kernels crash the profiler (segmentation fault)
    raise SystemExit(f"kda_ncu: unknown {which!r}; only 'ours'")
  args = bench.inputs(*shape)
  loss = lambda *a: jnp.sum(bench.ours(*a)[0].astype(jnp.float32))
  fb = bench.fwd_bwd(loss, len(args))
  for _ in range(2):
    jax.block_until_ready(fb(*args))
  print(which, "done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
