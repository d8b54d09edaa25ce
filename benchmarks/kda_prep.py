"""The KDA backward's pre-processing VJP on one GPU: check the Triton kernel
(``pallas_kernels/kda/prep_vjp.py``) against XLA's ``jax.vjp`` of ``gpu.preprocess`` (value-head
groups summed and results cast to the input dtypes, as ``_kda_bwd`` did before the kernel) at the
benchmark shape, time both side by side, then (budget permitting) other tilings. K3's settings:
L2 norm of q and k, bounded gate with lower bound -5, beta logits. Finishes in ~30 s on an H200.

  python3 benchmarks/kda_prep.py                  # B1 T16384 H32 K128 bf16 (HV = H)
  python3 benchmarks/kda_prep.py --budget 45      # seconds after which optional steps are skipped
  python3 benchmarks/kda_prep.py --no-sweep       # default tiling only
  python3 benchmarks/kda_prep.py --shape 1x40x2x64 --hv 4 --interpret   # CPU: the check path,
                                                  # kernel interpreted, one timing sample each

GB/s counts the minimal traffic: raw q, k, g, beta and the float32 cotangents read once, the
four results written once in the inputs' dtype. Every row is written to
``$OUT/kda_prep_bench.json`` as soon as it is measured.
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

from pallas_kernels.kda import config as kda_config, gpu, prep_vjp  # noqa: E402
from timing import Rows, config_diff, kernel_bench_args, print_ratios  # noqa: E402

ROWS = Rows("kda_prep_bench.json")
CHECK_TOL = 1e-2  # relative error vs XLA (both float32 inside, bf16 results)
NAMES = ("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias")
C = prep_vjp.Config
SWEEP = [C(block=32), C(block=64), C(warps=8), C(warps=2), C(rows=128), C(rows=512),
         C(rows=1024), C(block=64, warps=8)]


def k3_cfg():
  return kda_config.KdaOptions(scale=1.0, chunk=64, use_qk_l2norm=True, gate="bounded",
                               lower_bound=-5.0, beta_is_logit=True, diag_rows=0,
                               dtype="bfloat16")


def operands(b, t, h, hv, kd, dtype):
  """Raw q, k, g, beta (``dtype``), A_log [HV], dt_bias [HV, K] and the float32 cotangents."""
  ks = jax.random.split(jax.random.key(0), 10)
  n = lambda i, *s: jax.random.normal(ks[i], s, jnp.float32)
  return (n(0, b, t, h, kd).astype(dtype), n(1, b, t, h, kd).astype(dtype),
          n(2, b, t, hv, kd).astype(dtype), n(3, b, t, hv).astype(dtype), 0.5 * n(4, hv),
          0.5 * n(5, hv, kd), n(6, b, t, hv, kd), n(7, b, t, hv, kd), n(8, b, t, hv, kd),
          n(9, b, t, hv))


def xla_op(cfg):
  def f(q, k, g, beta, a_log, dtb, dq, dk, dg, dbeta):
    b, t, h, kd = q.shape
    grp = lambda x: x.reshape(b, t, h, g.shape[2] // h, kd).sum(3)
    _, vjp = jax.vjp(lambda *x: gpu.preprocess(cfg, *x), q, k, g, beta, a_log, dtb)
    out = vjp((grp(dq), grp(dk), dg, dbeta))
    return tuple(o.astype(x.dtype) for o, x in zip(out, (q, k, g, beta, a_log, dtb)))
  return jax.jit(f)


def kernel_op(cfg, config=prep_vjp.Config()):
  return jax.jit(lambda *a: prep_vjp.preprocess_vjp(cfg, *a, config=config))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="1x16384x32x128", help="B x T x H x K")
  p.add_argument("--hv", type=int, default=0, help="value heads (default H)")
  a, elapsed, left, reps = kernel_bench_args(p, budget=45.0)
  b, t, h, kd = (int(n) for n in a.shape.split("x"))
  hv = a.hv or h
  args = operands(b, t, h, hv, kd, jnp.dtype(a.dtype))
  traffic = sum(x.size * x.dtype.itemsize for x in args) + sum(
      x.size * x.dtype.itemsize for x in args[:4])
  print("jax", jax.__version__, jax.devices()[0],
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), f"B{b} T{t} H{h} HV{hv} K{kd} {a.dtype}, bounded gate lb -5, l2norm, beta logit, "
        f"minimal traffic {traffic / 1e9:.3f} GB", flush=True)
  cfg = k3_cfg()
  xla = xla_op(cfg)
  try:
    ROWS.check("check kda_prep_vjp vs xla", NAMES, kernel_op(cfg)(*args), xla(*args), CHECK_TOL)
  except Exception as e:  # noqa: BLE001 - the timings below are still worth having
    print("CHECK ERROR", repr(e)[:2000], flush=True)

  def timed(name, fn):
    return ROWS.times(name, {"vjp": (fn, args)}, {"vjp": traffic}, reps)["vjp"]

  res = {}
  for name, fn in (("xla", xla), ("pallas", kernel_op(cfg))):
    try:
      res[name] = timed(name, fn)
    except Exception as e:  # noqa: BLE001
      print(name, "FAILED", repr(e)[:1500], flush=True)
  if len(res) == 2:
    print_ratios([("vjp", res["xla"], res["pallas"], traffic)])
  for config in [] if a.no_sweep else SWEEP:
    if left() < 4:
      print(f"budget: sweep stopped before {config}", flush=True)
      break
    diff = config_diff(config, prep_vjp.Config())
    try:
      timed(f"pallas {diff}", kernel_op(cfg, config))
    except Exception as e:  # noqa: BLE001
      print(diff, "FAILED", repr(e)[:800], flush=True)
  print(f"done in {elapsed():.1f} s", flush=True)


if __name__ == "__main__":
  main()
