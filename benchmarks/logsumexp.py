"""Row log-sum-exp of the LM head's float32 logits on one GPU: check the Triton kernel against
float64 on the card, then time it beside XLA's one-pass reduction and XLA's two-pass
``jax.nn.logsumexp``, then (with --sweep) other tilings. Finishes in ~30 s on an H200.

  python3 benchmarks/logsumexp.py                 # one loss chunk: [4096, 163840] float32
  python3 benchmarks/logsumexp.py --dtype bfloat16 --sweep   # train.bf16_logits's chunk
  python3 benchmarks/logsumexp.py --shape 37x3001 --interpret   # CPU: the check path

GB/s counts one read of the input. Rows go to ``$OUT/logsumexp_bench.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.logsumexp import gpu, logsumexp  # noqa: E402
from timing import Rows, median_ms  # noqa: E402

ROWS = Rows("logsumexp_bench.json")
# Changes of the default tiling timed with --sweep (a change to the default itself is skipped).
SWEEP = [dict(rows=4), dict(rows=8), dict(rows=16), dict(cols=1024), dict(cols=4096),
         dict(splits=4), dict(splits=16), dict(stages=2), dict(stages=4), dict(warps=8)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="4096x163840", help="N x V")
  ap.add_argument("--interpret", action="store_true", help="one sample each (CPU check path)")
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  args = ap.parse_args()
  n, v = (int(s) for s in args.shape.split("x"))
  x = (jax.random.normal(jax.random.key(0), (n, v), jnp.float32) * 4.0).astype(args.dtype)
  reps = dict(reps=1, inner=1) if args.interpret else {}
  rows = np.random.default_rng(0).choice(n, size=min(n, 64), replace=False)
  x64 = np.asarray(x[rows], np.float64)
  m = x64.max(-1, keepdims=True)
  want = (m + np.log(np.exp(x64 - m).sum(-1, keepdims=True)))[:, 0]
  gbps = lambda ms: round(x.size * x.dtype.itemsize / ms / 1e6)

  def run(name, fn):
    got = np.asarray(fn(x))[rows]
    err = float(np.max(np.abs(got - want) / np.abs(want)))
    row = dict(name=name, max_rel_err=float(f"{err:.2e}"))
    if err > 1e-5:
      row["FAILED"] = True
    else:
      ms = median_ms(fn, x, **reps)
      row.update(ms=round(ms, 4), gbps=gbps(ms))
    ROWS.emit(row)

  run(f"xla one-pass N{n} V{v} {args.dtype}", jax.jit(lambda a: logsumexp(a, implementation="xla")))
  run("xla jax.nn.logsumexp (two passes)",
      jax.jit(lambda a: jax.nn.logsumexp(a.astype(jnp.float32), axis=-1)))
  default = gpu.default_config(x.dtype)
  pallas = lambda cfg: jax.jit(lambda a: logsumexp(a, implementation="pallas_gpu", config=cfg))
  tiles = lambda c: f"{c.rows}x{c.cols} splits {c.splits} w{c.warps} s{c.stages}"
  run(f"pallas {tiles(default)} (default)", pallas(default))
  if args.sweep:
    for change in SWEEP:
      cfg = dataclasses.replace(default, **change)
      if cfg != default:
        run(f"pallas {tiles(cfg)}", pallas(cfg))

if __name__ == "__main__":
  main()
