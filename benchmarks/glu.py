"""The routed experts' packed SiTU-GLU on one GPU: check the Triton kernels against XLA's fusion
of the same maths at k3_1b's shape, then time forward and forward+backward side by side, then
(with --sweep) other tiles. Finishes in ~30 s on an H200.

  python3 benchmarks/glu.py                       # gu [524288, 1024] bf16 (16 x 4096 tokens, top 8)
  python3 benchmarks/glu.py --shape 37x80 --interpret   # CPU: the check path, one sample each

Forward+backward is ``jax.vjp`` returning h and d gu for a given cotangent, so h is materialised
as in training. GB/s counts the minimal traffic: forward gu + h; backward gu, g and d gu.
Rows go to ``$OUT/glu_bench.json`` as they are measured.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.glu import glu_packed, gpu  # noqa: E402
from timing import Rows, median_ms, rel_err  # noqa: E402

ROWS = Rows("glu_bench.json")
SWEEP = [gpu.Config(16, 128, 4), gpu.Config(16, 256, 4), gpu.Config(8, 128, 4),
         gpu.Config(4, 256, 4), gpu.Config(8, 256, 8)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="524288x1024", help="M x 2F")
  ap.add_argument("--interpret", action="store_true", help="one sample each (CPU check path)")
  ap.add_argument("--sweep", action="store_true")
  args = ap.parse_args()
  m, f2 = (int(v) for v in args.shape.split("x"))
  k1, k2 = jax.random.split(jax.random.key(0))
  gu = (jax.random.normal(k1, (m, f2), jnp.float32) * 3).astype(jnp.bfloat16)
  g = jax.random.normal(k2, (m, f2 // 2), jnp.bfloat16)
  reps = dict(reps=1, inner=1) if args.interpret else {}

  def fns(impl, config=None):
    fwd = jax.jit(lambda x: glu_packed(x, "situ", implementation=impl, config=config))

    @jax.jit
    def both(x, dy):
      y, vjp = jax.vjp(lambda z: glu_packed(z, "situ", implementation=impl, config=config), x)
      return y, vjp(dy)[0]
    return fwd, both

  ref_f, ref_b = fns("xla")
  want = ref_b(gu, g)

  def run(config, tag=""):
    fwd, both = fns("pallas_gpu", config)
    tag = f"pallas {config.block_m}x{config.block_f} w{config.warps}{tag}"
    got = both(gu, g)
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    row = dict(name=tag, err_h=round(errs[0], 5), err_dgu=round(errs[1], 5))
    if max(errs) > 1e-2:
      row["FAILED"] = True
      ROWS.emit(row)
      return
    t_f, t_b = median_ms(fwd, gu, **reps), median_ms(both, gu, g, **reps)
    row.update(fwd_ms=round(t_f, 4), fwd_bwd_ms=round(t_b, 4),
               fwd_gbps=round(gu.size * 3 // 2 * 2 / t_f / 1e6),
               fwd_bwd_gbps=round((gu.size * 3 // 2 * 2 + gu.size * 5 // 2 * 2) / t_b / 1e6))
    ROWS.emit(row)

  t_f, t_b = median_ms(ref_f, gu, **reps), median_ms(ref_b, gu, g, **reps)
  ROWS.emit(dict(name=f"xla M{m} 2F{f2}", fwd_ms=round(t_f, 4), fwd_bwd_ms=round(t_b, 4)))
  run(gpu.Config(), " (default)")
  if args.sweep:
    for config in SWEEP:
      run(config)


if __name__ == "__main__":
  main()
