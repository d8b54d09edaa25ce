"""Causal short conv + SiLU (the KDA layer's q/k/v convs) on one GPU: check the Pallas kernels
against the XLA reference at the benchmark shape, then time forward and forward+backward of both
side by side, then (budget permitting) other kernel tilings. Finishes in ~40 s on an H200.

  python3 benchmarks/conv.py                      # B16 T4096 C1024 bf16, W=4, packed documents
  python3 benchmarks/conv.py --budget 45          # seconds after which optional steps are skipped
  python3 benchmarks/conv.py --no-sweep           # default tiling only
  python3 benchmarks/conv.py --shape 2x300x256 --interpret   # CPU: the check path, kernels in
                                                  # interpret mode, one timing sample each

Forward+backward is ``jax.vjp`` returning y and (dx, dw) for a given cotangent dy, so y is
materialised as in training (a scalar loss such as ``sum(y * dy)`` would let XLA fuse the
reference's forward into the loss and skip writing y). GB/s counts the minimal traffic: forward
x + y (+ segment ids), forward+backward x twice, y, dy, dx (+ segment ids twice). Every row is
written to ``$OUT/conv_bench.json`` as soon as it is measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.conv import causal_conv_silu, gpu  # noqa: E402
from timing import Rows, config_diff, kernel_bench_args, xla_against_pallas  # noqa: E402

ROWS = Rows("conv_bench.json")
CHECK_TOL = 1e-2  # relative error of the kernels vs the reference (both float32 inside, bf16 out)
# Tilings tried after the default (rows and channels per program, warps, rows per load group).
SWEEP = [gpu.Config(bc=512, warps=4, bwd_bc=512, bwd_warps=4),
         gpu.Config(bc=128, warps=1, bwd_bc=128, bwd_warps=1),
         gpu.Config(unroll=8, bwd_unroll=8), gpu.Config(unroll=2, bwd_unroll=2),
         gpu.Config(rows=128, bwd_rows=128), gpu.Config(rows=32, bwd_rows=32)]


def segments(b, t, seed=0):
  """[B, T] int32 ids of packed documents with lengths uniform in ~[100, 4000] (scaled to T)."""
  rng = np.random.default_rng(seed)
  lo = max(1, min(100, t // 8))
  hi = max(lo + 1, min(4000, t))
  ids = np.zeros((b, t), np.int32)
  for r in range(b):
    pos, doc = 0, 0
    while pos < t:
      n = int(rng.integers(lo, hi))
      ids[r, pos:pos + n] = doc
      pos, doc = pos + n, doc + 1
  return jnp.asarray(ids)


def operands(b, t, c, width, dtype):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (b, t, c), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (width, c), jnp.float32) / width ** 0.5).astype(dtype)
  dy = jax.random.normal(kd, (b, t, c), jnp.float32).astype(dtype)
  return x, w, segments(b, t), dy


def ops(impl=None, config=None):
  """(forward, forward+backward) jitted: x, w, seg[, dy] -> y or (y, dx, dw)."""
  if config is None:
    f = lambda x, w, s: causal_conv_silu(x, w, s, implementation=impl)
  else:
    f = lambda x, w, s: gpu.causal_conv_silu(x, w, s, config)

  def fb(x, w, s, dy):
    y, vjp = jax.vjp(lambda x, w: f(x, w, s), x, w)
    return (y, *vjp(dy))

  return jax.jit(f), jax.jit(fb)


def check(args):
  """pallas_gpu vs xla: y, dx, dw relative errors at the benchmark shape."""
  x, w, s, dy = args
  ROWS.check("check pallas_gpu vs xla", ("y", "dx", "dw"), ops("pallas_gpu")[1](x, w, s, dy),
             ops("xla")[1](x, w, s, dy), CHECK_TOL)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="16x4096x1024", help="B x T x C")
  p.add_argument("--width", type=int, default=4)
  a, elapsed, left, reps = kernel_bench_args(p, budget=75.0)
  b, t, c = (int(n) for n in a.shape.split("x"))
  dtype = jnp.dtype(a.dtype)
  args = operands(b, t, c, a.width, dtype)
  unit = b * t * c * dtype.itemsize
  traffic = {"fwd": 2 * unit + b * t * 4, "fwdbwd": 5 * unit + 2 * b * t * 4}
  print("jax", jax.__version__, jax.devices()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"B{b} T{t} C{c} W{a.width} {dtype.name}, {int(args[2][:, -1].sum()) + b} documents",
        flush=True)
  try:
    check(args)
  except Exception as e:  # noqa: BLE001 - the timings below are still worth having
    print("CHECK ERROR", repr(e)[:2000], flush=True)

  def timed(name, fwd, fb):
    return ROWS.times(name, {"fwd": (fwd, args[:3]), "fwdbwd": (fb, args)}, traffic, reps)

  xla_against_pallas(lambda impl: timed(impl, *ops(impl)), traffic, ("fwd", "fwdbwd"))
  for cfg in [] if a.no_sweep else SWEEP:
    if left() < 6:
      print(f"budget: sweep stopped before {cfg}", flush=True)
      break
    diff = config_diff(cfg, gpu.Config())
    try:
      timed(f"pallas_gpu {diff}", *ops(config=cfg))
    except Exception as e:  # noqa: BLE001
      print(diff, "FAILED", repr(e)[:800], flush=True)
  print(f"done in {elapsed():.1f} s", flush=True)


if __name__ == "__main__":
  main()
