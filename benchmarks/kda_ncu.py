"""One forward+backward of KDA at B1 T16384 H32 K128 (bf16), ours or jla's, for Nsight Compute:

  ncu --clock-control none -k regex:kda_ python3 benchmarks/kda_ncu.py ours
  ncu --clock-control none python3 benchmarks/kda_ncu.py jla

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
  q, k, v, f, beta, a_log, dt_bias = bench.inputs(*shape)
  if which == "ours":
    loss = lambda *a: jnp.sum(bench.ours(*a)[0].astype(jnp.float32))
    args = (q, k, v, f, beta, a_log, dt_bias)
  else:
    from jla.ops.mosaic_gpu.kda import kda as jla_kda
    loss = lambda *a: jnp.sum(jla_kda(*a, use_qk_l2norm=True)[0].astype(jnp.float32))
    g = bench.LB * jax.nn.sigmoid(f.astype(jnp.float32))
    args = (q, k, v, g, jax.nn.sigmoid(beta.astype(jnp.float32)).astype(jnp.bfloat16))
  fb = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
  for _ in range(2):
    jax.block_until_ready(fb(*args))
  print(which, "done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
