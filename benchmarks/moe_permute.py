"""The MoE token permutation on one GPU at the k3_1b step shape: the expansion into expert order
(permute's row gather) and the unpermute (weighted sum of each token's k expert rows). Checks the
Triton kernels against XLA, then times XLA and the kernels side by side (expansion; unpermute
forward, forward+backward, backward alone), then (budget permitting) other tilings. Finishes in
~40 s on an H200.

  python3 benchmarks/moe_permute.py               # N65536 k8 D512 bf16, float32 weights, E48
  python3 benchmarks/moe_permute.py --budget 50   # seconds after which optional steps are skipped
  python3 benchmarks/moe_permute.py --no-sweep    # default tiling only
  python3 benchmarks/moe_permute.py --shape 300x8x96 --interpret   # CPU: the check path, the
                                                  # kernels interpreted, one timing sample each

Expert ids are a random routing (top-k of Gaussian scores over E experts, so the groups are
ragged), order their stable sort. Unpermute forward+backward is ``jax.vjp`` returning out and
(dy, dweights) for a fixed cotangent g, so out is materialised as in training; the backward alone
is the same VJP with out unused (XLA drops the forward but keeps the inverse permutation its
backward gathers with). GB/s counts the minimal traffic: expansion x + xs + order; unpermute
forward y + out + order + weights, backward y + g + dy + order + weights + dweights. Every row is
written to ``$OUT/permute_bench.json`` as it comes.
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

from pallas_kernels import moe  # noqa: E402
from pallas_kernels.moe import permute_gpu, reference  # noqa: E402
from timing import (Rows, config_diff, kernel_bench_args, print_ratios,  # noqa: E402
                    xla_against_pallas)

ROWS = Rows("permute_bench.json")
CHECK_TOL = 1e-5  # dy is the same rounded product (equal); out is the same XLA forward
# Tilings timed after the default (rows per program, D tile, warps).
SWEEP = [permute_gpu.Config(rows=8), permute_gpu.Config(rows=32),
         permute_gpu.Config(rows=32, warps=8), permute_gpu.Config(rows=64, warps=8),
         permute_gpu.Config(rows=16, warps=8), permute_gpu.Config(rows=4, warps=2),
         permute_gpu.Config(rows=32, block_d=256), permute_gpu.Config(rows=64, block_d=128),
         permute_gpu.Config(rows=8, warps=2)]


def operands(n, k, d, experts, dtype):
  """y ``[N*k, D]``, order ``[N*k]``, weights ``[N, k]`` float32, g ``[N, D]``."""
  ks = jax.random.split(jax.random.key(0), 4)
  ids = jax.lax.top_k(jax.random.normal(ks[0], (n, experts)), k)[1]
  order = jnp.argsort(ids.reshape(-1), stable=True).astype(jnp.int32)
  y = jax.random.normal(ks[1], (n * k, d), jnp.float32).astype(dtype)
  w = jax.random.uniform(ks[2], (n, k), jnp.float32, 0.1, 1.0)
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  g = jax.random.normal(ks[3], (n, d), jnp.float32).astype(dtype)
  return y, order, w, g


def ops(impl=None, config=None):
  """Jitted (forward, forward+backward, backward): y, order, w[, g] -> out | (out, dy, dw) |
  (dy, dw)."""
  if config is None:
    f = lambda y, o, w: moe.unpermute(y, o, w, implementation=impl)
  else:
    f = lambda y, o, w: permute_gpu.unpermute(y, o, w, config=config)

  def fb(y, o, w, g):
    out, vjp = jax.vjp(lambda y, w: f(y, o, w), y, w)
    return (out, *vjp(g))

  return jax.jit(f), jax.jit(fb), jax.jit(lambda *a: fb(*a)[1:])


def check(name, fb, want, args):
  """``fb``'s (out, dy, dw) vs ``want``: relative errors; prints CHECK FAILED past CHECK_TOL."""
  ROWS.check(f"check {name} vs xla", ("out", "dy", "dw"), fb(*args), want, CHECK_TOL)


def expansion(args, n, k, d, dtype, reps, left, no_sweep):
  """``x[order // k]`` by XLA (the reference's gather) and by the kernel: check, time, sweep."""
  order = args[1]
  inverse = reference.inverse_map(order)
  x = jax.random.normal(jax.random.key(1), (n, d), jnp.float32).astype(dtype)
  traffic = {"expand": (n * k + n) * d * dtype.itemsize + 4 * n * k}
  xla = jax.jit(lambda x, o, i: jnp.take(x, o // k, axis=0))
  kernel = lambda cfg: jax.jit(lambda x, o, i: permute_gpu.expand(x, o, i, k, cfg))
  default = permute_gpu.EXPAND_CONFIG
  ROWS.check("check expand pallas_gpu vs xla", ("xs",), (kernel(default)(x, order, inverse),),
             (xla(x, order, inverse),), CHECK_TOL)
  res = {name: ROWS.times(f"expand {name}", {"expand": (fn, (x, order, inverse))}, traffic,
                          reps)["expand"]
         for name, fn in (("xla", xla), ("pallas_gpu", kernel(default)))}
  print_ratios([("expand", res["xla"], res["pallas_gpu"], traffic["expand"])])
  for cfg in [] if no_sweep else SWEEP:
    if left() < 3:
      print(f"budget: expansion sweep stopped before {cfg}", flush=True)
      break
    ROWS.times(f"expand pallas_gpu {config_diff(cfg, default)}",
               {"expand": (kernel(cfg), (x, order, inverse))}, traffic, reps)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="65536x8x512", help="N x k x D")
  p.add_argument("--experts", type=int, default=48)
  a, elapsed, left, reps = kernel_bench_args(p, budget=50.0)
  n, k, d = (int(v) for v in a.shape.split("x"))
  dtype = jnp.dtype(a.dtype)
  args = operands(n, k, d, a.experts, dtype)
  rows_b, tok_b = n * k * d * dtype.itemsize, n * d * dtype.itemsize
  traffic = {"fwd": rows_b + tok_b + 8 * n * k, "bwd": 2 * rows_b + tok_b + 12 * n * k}
  traffic["fwdbwd"] = traffic["fwd"] + traffic["bwd"]
  print("jax", jax.__version__, jax.devices()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"N{n} k{k} D{d} E{a.experts} {dtype.name}; minimal traffic fwd "
        f"{traffic['fwd'] / 1e9:.3f} GB, bwd {traffic['bwd'] / 1e9:.3f} GB", flush=True)
  want = ops("xla")[1](*args)
  try:
    check("pallas_gpu", ops("pallas_gpu")[1], want, args)
  except Exception as e:  # noqa: BLE001 - the timings below are still worth having
    print("CHECK ERROR", repr(e)[:2000], flush=True)

  def timed(name, fwd, fb, bwd, parts=("fwd", "fwdbwd", "bwd")):
    fns = {"fwd": (fwd, args[:3]), "fwdbwd": (fb, args), "bwd": (bwd, args)}
    return ROWS.times(name, {p: fns[p] for p in parts}, traffic, reps)

  res = xla_against_pallas(lambda impl: timed(impl, *ops(impl)), traffic, ("fwd", "fwdbwd", "bwd"))
  best = (res.get("pallas_gpu", {}).get("bwd", float("inf")), permute_gpu.Config())
  for cfg in [] if a.no_sweep else SWEEP:
    if left() < 4:
      print(f"budget: sweep stopped before {cfg}", flush=True)
      break
    diff = config_diff(cfg, permute_gpu.Config())
    try:
      fns = ops(config=cfg)
      check(f"pallas_gpu {diff}", fns[1], want, args)
      ms = timed(f"pallas_gpu {diff}", *fns, parts=("bwd",))["bwd"]
      best = min(best, (ms, cfg), key=lambda t: t[0])
    except Exception as e:  # noqa: BLE001
      print(diff, "FAILED", repr(e)[:800], flush=True)
  print(f"fastest backward: {best[1]} {best[0]:.3f} ms", flush=True)
  expansion(args, n, k, d, dtype, reps, left, a.no_sweep)
  print(f"done in {elapsed():.1f} s", flush=True)


if __name__ == "__main__":
  main()
