"""Exact QB's per-expert k-th smallest margin on one GPU: check the Pallas kernel
(:mod:`pallas_kernels.select.gpu`) bit for bit against np.sort at QB's shape, then time it beside
the XLA radix select (the reference), then (budget permitting) other kernel configurations, each
checked too, then a table. Finishes in ~45 s on an H200 (the sweep stops at ``--budget``).

  python3 benchmarks/radix_select.py                   # N 65536 tokens, E 48 experts, k = N * 8 / 48
  python3 benchmarks/radix_select.py --budget 45       # seconds after which sweep steps are skipped
  python3 benchmarks/radix_select.py --n 700 --e 5 --interpret   # CPU: the check path, interpreted

Margins are shaped like QB's: float32 normal * 0.1 with 5% +inf rows (padding tokens). Times
are medians of 20 samples of 5 back-to-back calls after a warm-up, each sample synchronised;
"pallas" includes the XLA key map + transpose before the kernel, "kernel only" starts from the
keys; "quantile_bias" is one MoE layer's whole exact QB (4 iterations) with either select. A
training step makes ``4 * layers`` calls (60 at K3's 15 MoE layers). Every row is written to
``$OUT/select_bench.json`` as soon as it is measured.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import time  # noqa: E402

_T0 = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.select as select_op  # noqa: E402
from k3jax import router  # noqa: E402
from k3jax.config import MoEConfig  # noqa: E402
from pallas_kernels.select import gpu, kth_smallest, reference  # noqa: E402
from timing import Rows, median_ms  # noqa: E402

ROWS = Rows("select_bench.json")
# Kernel configurations tried after the default, most telling first (full_bits=30: nearly every
# pass over the whole row, the kernel without its candidate compaction)
SWEEP = [gpu.Config(full_bits=30, cand_bits=2), gpu.Config(prefetch=False), gpu.Config(full_bits=8),
         gpu.Config(full_bits=16),
         gpu.Config(bits=1, rows=16), gpu.Config(bits=4, full_bits=8, rows=4),
         gpu.Config(cand_bits=2), gpu.Config(rows=4), gpu.Config(rows=16),
         gpu.Config(warps=4, rows=16), gpu.Config(warps=16, rows=4),
         gpu.Config(bits=4, full_bits=12, rows=4)]


def margins(n, e, seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((n, e)) * 0.1).astype(np.float32)
  x[rng.random(n) < 0.05] = np.inf
  return x


def want(x, k):
  """np.sort's k-th row as uint32 bits."""
  return np.sort(x, axis=0)[k].view(np.uint32)


def check(name, fn, x, ks, sorted_x):
  bad = {}
  for k in ks:
    got = np.asarray(fn(jnp.asarray(x), jnp.int32(k))).view(np.uint32)
    wrong = int(np.sum(got != sorted_x[k].view(np.uint32)))
    if wrong:
      bad[k] = wrong
  ROWS.emit({"name": f"check {name}", "ks": list(ks), "wrong_columns": bad})
  if bad:
    print(f"CHECK FAILED {name}: wrong columns per k {bad}", flush=True)
  return not bad


def qb_step(n, e, top_k, reps):
  """One layer's exact QB (``router.quantile_bias``, 4 iterations: top-k cutoffs, margins and the
  select each), traced once with the select on each implementation; the two biases must agree."""
  cfg = MoEConfig(num_experts=e, top_k=top_k, balancing="quantile", balancing_iters=4)
  scores = jax.nn.sigmoid(jax.random.normal(jax.random.key(1), (n, e)) + jnp.linspace(-1, 1, e))
  bias = jnp.zeros((e,), jnp.float32)
  out = {}
  for impl in ("xla", "pallas_gpu"):
    fn = jax.jit(lambda s, b: router.quantile_bias(s, b, cfg))
    saved = select_op.resolve
    select_op.resolve = lambda _, impl=impl: impl  # the select router.kth_smallest traces
    try:
      out[impl] = np.asarray(fn(scores, bias))
    finally:
      select_op.resolve = saved
    ROWS.emit({"name": f"quantile_bias x4 iters, select {impl}",
               "ms": round(median_ms(fn, scores, bias, **reps), 4)})
  same = bool(np.array_equal(out["xla"].view(np.uint32), out["pallas_gpu"].view(np.uint32)))
  ROWS.emit({"name": "check quantile_bias pallas_gpu == xla bit for bit", "equal": same})


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--n", type=int, default=65536)
  p.add_argument("--e", type=int, default=48)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--budget", type=float, default=45.0, help="seconds from start, imports included")
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument("--interpret", action="store_true", help="allow a CPU run (kernel interpreted)")
  a = p.parse_args()
  left = lambda: a.budget - (time.perf_counter() - _T0)
  if jax.default_backend() != "gpu" and not a.interpret:
    sys.exit("select.py: no GPU (pass --interpret to run the check path on CPU)")
  n, e = a.n, a.e
  k = min(n * a.top_k // e, n - 1)
  x = margins(n, e)
  xs = jnp.asarray(x)
  kk = jnp.int32(k)
  sorted_x = np.sort(x, axis=0)
  ks = sorted({0, k, n - 1})
  reps = dict(reps=1, inner=1) if a.interpret else dict(reps=20, inner=5)
  print("jax", jax.__version__, jax.devices()[0],
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"N {n} E {e} k {k}, default {gpu.Config()}", flush=True)
  fns = {"xla": jax.jit(lambda x, k: kth_smallest(x, k, implementation="xla")),
         "pallas": jax.jit(lambda x, k: kth_smallest(x, k, implementation="pallas_gpu"))}
  res = {}
  for name, fn in fns.items():
    try:
      check(name, fn, x, ks, sorted_x)
      res[name] = median_ms(fn, xs, kk, **reps)
      ROWS.emit({"name": name, "ms": round(res[name], 4)})
    except Exception as err:  # noqa: BLE001 - the other timings are still worth having
      print(name, "FAILED", repr(err)[:2000], flush=True)
  try:
    cfg = gpu.Config()
    cols = 128 * cfg.warps
    keys = jnp.pad(reference.to_keys(xs).T, ((0, 0), (0, -n % (cfg.rows * cols))),
                   constant_values=jnp.uint32(0xFFFFFFFF)).reshape(e, -1, cols)
    kernel = jax.jit(lambda keys, k: gpu.kth_keys(keys, k, cfg))
    ms = median_ms(kernel, keys, kk.reshape(1), **reps)
    ROWS.emit({"name": "kernel only", "ms": round(ms, 4)})
  except Exception as err:  # noqa: BLE001
    print("kernel only FAILED", repr(err)[:1000], flush=True)
  try:
    qb_step(n, e, a.top_k, reps)
  except Exception as err:  # noqa: BLE001
    print("quantile_bias FAILED", repr(err)[:1000], flush=True)
  if len(res) == 2:
    print(f"xla {res['xla']:.4f} ms, pallas {res['pallas']:.4f} ms per call: speedup "
          f"{res['xla'] / res['pallas']:.2f}x; x60 calls per step: {60 * res['xla']:.2f} -> "
          f"{60 * res['pallas']:.2f} ms", flush=True)
  for cfg in [] if a.no_sweep else SWEEP:
    if left() < 4:
      print(f"budget: sweep stopped before {cfg}", flush=True)
      break
    diff = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(gpu.Config(), f.name)}
    try:
      fn = jax.jit(lambda x, k, cfg=cfg: gpu.kth_smallest(x, k, cfg))
      if check(f"pallas {diff}", fn, x, [k], sorted_x):
        ROWS.emit({"name": f"pallas {diff}", "ms": round(median_ms(fn, xs, kk, **reps), 4)})
    except Exception as err:  # noqa: BLE001
      print(diff, "FAILED", repr(err)[:800], flush=True)
  print(f"\n{'configuration':58s}{'ms':>9s}{'xla/this':>10s}", flush=True)
  timed = {row["name"]: row["ms"] for row in ROWS.rows if "ms" in row}
  for name, ms in timed.items():  # against the XLA select, or exact QB with the XLA select
    base = timed.get("quantile_bias x4 iters, select xla" if name.startswith("quantile") else "xla")
    print(f"{name:58s}{ms:9.4f}" + (f"{base / ms:10.2f}" if base else ""), flush=True)
  print(f"done in {time.perf_counter() - _T0:.1f} s", flush=True)


if __name__ == "__main__":
  main()
