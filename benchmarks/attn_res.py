"""Block AttnRes mixing on one GPU: check the Pallas kernels against the XLA reference at the
benchmark shape, then time forward and forward+backward of both side by side for S = 2, 3, 5
sources, then (budget permitting) other kernel tilings. Finishes in ~75 s on an H200.

  python3 benchmarks/attn_res.py                  # [16, 4096, 1024] bf16 sources, S = 2, 3, 5
  python3 benchmarks/attn_res.py --budget 60      # seconds after which optional steps are skipped
  python3 benchmarks/attn_res.py --no-sweep       # default tiling only
  python3 benchmarks/attn_res.py --shape 2x64x256 --interpret   # CPU: the check path, kernels
                                                  # in interpret mode, one timing sample each

Forward+backward is ``jax.vjp`` returning out and the cotangents of every source, proj and norm
for a given cotangent g, so out is materialised as in training. GB/s counts the minimal traffic
in units of one ``[B, T, d]`` array: forward S + 1 (read the sources, write out),
forward+backward 3S + 2 (forward, then read the sources and g, write S source gradients). Every
row is written to ``$OUT/attn_res_bench.json`` as soon as it is measured.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.attn_res import attn_res, gpu  # noqa: E402
from timing import Rows, config_diff, kernel_bench_args, print_ratios  # noqa: E402

ROWS = Rows("attn_res_bench.json")
CHECK_TOL = 1e-2  # relative error of the kernels vs the reference (both float32 inside, bf16 out)
EPS = 1e-5
# Tilings tried after the default, each timed where it differs: forward-only changes on the
# forward, backward-only changes on forward+backward. ``regs=256`` keeps the given row tile
# (the default halves it for many sources); the 256-column tiles are the chunked form (two
# passes over d per row block, the second from cache).
_C = functools.partial(gpu.Config, regs=256)
SWEEP = [("fwdbwd", _C(bwd_br=4)), ("fwdbwd", _C(bwd_br=2, bwd_warps=4)),
         ("fwdbwd", _C(bwd_br=1, bwd_warps=4)), ("fwdbwd", _C(bwd_br=1)),
         ("fwdbwd", _C(bwd_br=8, bwd_bd=256, bwd_warps=4)), ("fwdbwd", _C(bwd_br=16, bwd_bd=256)),
         ("fwd", _C()), ("fwd", _C(br=1)), ("fwd", _C(br=4)), ("fwd", _C(warps=8)),
         ("fwd", _C(br=16, bd=256)), ("fwdbwd", gpu.Config(bwd_steps=64)),
         ("fwdbwd", gpu.Config(bwd_steps=4)), ("fwd", _C(br=8, bd=256))]


def operands(s, b, t, d, dtype):
  """S sources of different scales, proj ~ 2/sqrt(d) (logits of order one), norm ~ 1, g."""
  keys = jax.random.split(jax.random.key(0), s + 3)
  srcs = tuple((jax.random.normal(keys[i], (b, t, d), jnp.float32) * (1 + i)).astype(dtype)
               for i in range(s))
  proj = jax.random.normal(keys[s], (d,), jnp.float32) * 2 / d ** 0.5
  norm = 1 + 0.5 * jax.random.normal(keys[s + 1], (d,), jnp.float32)
  g = jax.random.normal(keys[s + 2], (b, t, d), jnp.float32).astype(dtype)
  return srcs, proj, norm, g


def ops(impl=None, config=None):
  """(forward, forward+backward) jitted: srcs, proj, norm[, g] -> out or (out, *grads)."""
  if config is None:
    f = lambda s, p, n: attn_res(s, p, n, EPS, implementation=impl)
  else:
    f = lambda s, p, n: gpu.attn_res(s, p, n, EPS, config)

  def fb(s, p, n, g):
    out, vjp = jax.vjp(f, s, p, n)
    return (out, *jax.tree.leaves(vjp(g)))

  return jax.jit(f), jax.jit(fb)


def check(args):
  """pallas_gpu vs xla: out, every source gradient, dproj, dnorm relative errors."""
  s = len(args[0])
  names = ("out", *(f"dv{i}" for i in range(s)), "dproj", "dnorm")
  ROWS.check(f"check S={s} pallas_gpu vs xla", names, ops("pallas_gpu")[1](*args),
             ops("xla")[1](*args), CHECK_TOL)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="16x4096x1024", help="B x T x d")
  p.add_argument("--sources", default="2,3,5", help="numbers of sources S to time")
  a, elapsed, left, reps = kernel_bench_args(p, budget=70.0)
  b, t, d = (int(n) for n in a.shape.split("x"))
  dtype = jnp.dtype(a.dtype)
  counts = [int(n) for n in a.sources.split(",")]
  unit = b * t * d * dtype.itemsize
  traffic = lambda s: {"fwd": (s + 1) * unit, "fwdbwd": (3 * s + 2) * unit}
  print("jax", jax.__version__, jax.devices()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"B{b} T{t} d{d} {dtype.name}, S in {counts}, default {gpu.Config()}", flush=True)
  args = {s: operands(s, b, t, d, dtype) for s in counts}
  for s in (min(counts), max(counts)):
    try:
      check(args[s])
    except Exception as e:  # noqa: BLE001 - the timings below are still worth having
      print("CHECK ERROR", repr(e)[:2000], flush=True)

  def timed(name, s, fwd, fb, which=("fwd", "fwdbwd"), cfg=gpu.Config()):
    fns = {"fwd": (fwd, args[s][:3]), "fwdbwd": (fb, args[s])}
    extra = {"S": s}
    if name != "xla":  # the tiles the kernels ran with (rows, columns)
      extra.update(zip(("fwd_tile", "bwd_tile"), gpu.tiles(cfg, s, b * t, d)))
    return ROWS.times(name, {k: fns[k] for k in which}, traffic(s), reps, **extra)

  res = {}
  for s in counts:
    for impl in ("xla", "pallas_gpu"):
      try:
        res[s, impl] = timed(impl, s, *ops(impl))
      except Exception as e:  # noqa: BLE001
        print(impl, s, "FAILED", repr(e)[:1500], flush=True)
  print_ratios([(f"{k} S={s}", res[s, "xla"][k], res[s, "pallas_gpu"][k], traffic(s)[k])
                for s in counts if (s, "xla") in res and (s, "pallas_gpu") in res
                for k in ("fwd", "fwdbwd")])
  for which, cfg in [] if a.no_sweep else SWEEP:
    diff = config_diff(cfg, gpu.Config())
    for s in (min(counts), max(counts)):
      if left() < 5:
        print(f"budget: sweep stopped before {diff} S={s}", flush=True)
        break
      try:
        timed(f"pallas_gpu {diff}", s, *ops(config=cfg), which=(which,), cfg=cfg)
      except Exception as e:  # noqa: BLE001
        print(diff, s, "FAILED", repr(e)[:800], flush=True)
    else:
      continue
    break
  print(f"done in {elapsed():.1f} s", flush=True)


if __name__ == "__main__":
  main()
