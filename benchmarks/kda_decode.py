"""KDA decode on one GPU: one new token for N requests against a float32 pool of states updated
in place (H=32, K=V=128), reported as state traffic (read + write) per second.

  python3 benchmarks/kda_decode.py           # every tuning of decode.SWEEP at N=256, each checked
                                             # vs the XLA path, with ceiling references (XLA and
                                             # Pallas in-place scaling of the pool), then N=64
                                             # fastest first, within --budget (75 s) (~85 s)
  python3 benchmarks/kda_decode.py --peers   # then fla's fused_recurrent_kda at the same Ns
  python3 benchmarks/kda_decode.py --ns 3 --heads 2  # CPU dry run (kernels interpreted)

``benchmarks/kda.py`` times the default tuning beside the training kernels (:func:`decode`).
Every row is written to ``$OUT/kda_decode.json`` as soon as it is measured.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from pallas_kernels.kda import config, kda_decode  # noqa: E402
from pallas_kernels.kda import decode as dec  # noqa: E402
from timing import Rows, config_diff, rel_err as rel  # noqa: E402

DECODE_N = (64, 256)
LB = -5.0
_ROWS = Rows("kda_decode.json")


def emit(**r):
  """Prints one result row and rewrites $OUT/kda_decode.json (a run cut short keeps its rows)."""
  _ROWS.emit(r)


def decode_inputs(n, h=32, kd=128, gate=None):
  """One token for N requests (bf16 q, k, v; float32 log decay in (-1, 0), or with ``gate`` the
  raw gate input f (bf16); beta in (0, 1)) and a float32 pool of N states."""
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (n, 1, h, kd), jnp.bfloat16) for key in ks[:3])
  beta = jax.random.normal(ks[3], (n, 1, h), jnp.bfloat16)
  g = (-jax.random.uniform(jax.random.key(5), (n, 1, h, kd), jnp.float32) if gate is None
       else jax.random.normal(jax.random.key(5), (n, 1, h, kd), jnp.bfloat16))
  pool = jax.random.normal(jax.random.key(6), (n, h, kd, kd), jnp.float32)
  return (q, k, v, g, jax.nn.sigmoid(beta)), pool


def kda_gpu_decode(q, k, v, g, b, s, slots, cfg=dec.DecodeConfig(), gate=None):
  """The decode kernel with L2 norm fused, beta precomputed and the decay precomputed (or with
  ``gate`` computed in the kernel from the raw f, A_log 0 and dt_bias 0); ``cfg``: its tuning."""
  h, kd = g.shape[-2:]
  zeros = lambda *shape: jnp.zeros(shape, jnp.float32) if gate else None
  return dec.decode_gpu(q, k, v, g, b, s, slots, scale=q.shape[-1] ** -0.5, use_qk_l2norm=True,
                        A_log=zeros(h), dt_bias=zeros(h * kd), gate=gate, lower_bound=LB,
                        beta_is_logit=False, config=cfg)


def time_donated(fn, args, pool, reps=15, inner=20):
  """Median ms per call of ``fn(*args, pool) -> (..., pool)`` (the pool donated), over ``reps``
  samples of ``inner`` back-to-back calls. Returns ``(ms, pool)``."""
  pool = fn(*args, pool)[-1]
  jax.block_until_ready(pool)
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      pool = fn(*args, pool)[-1]
    jax.block_until_ready(pool)
    ts.append((time.perf_counter() - t0) / inner)
  ts.sort()
  return ts[len(ts) // 2] * 1e3, pool


def state_tbps(pool_shape, ms):
  """State traffic (read + write) per second in TB/s."""
  return 2 * 4 * math.prod(pool_shape) / ms / 1e9


def time_decode(n, cfg=dec.DecodeConfig(), gate=None):
  args, pool = decode_inputs(n, gate=gate)
  slots = jnp.arange(n, dtype=jnp.int32)
  step = jax.jit(lambda *a: kda_gpu_decode(*a, slots, cfg, gate=gate), donate_argnums=(5,))
  ms, _ = time_donated(step, args, pool)
  return ms, state_tbps(pool.shape, ms)


def decode(ns=DECODE_N, gates=(None,)):
  """The default decode kernel at each N and gate (None: the decay precomputed; "bounded",
  "softplus": computed in the kernel) (:func:`decode_sweep` times the other tunings)."""
  for gate in gates:
    for n in ns:
      label = f" {gate}" if gate else ""
      try:
        ms, tbps = time_decode(n, gate=gate)
        emit(name=f"ours decode{label} N{n} H32 K128", ms=round(ms, 4), tbps=round(tbps, 2))
      except Exception as e:  # noqa: BLE001
        print(f"decode{label} N{n} FAILED", repr(e)[:1500], flush=True)


def _copy_kernel(s_ref, so_ref, *, bv, nvt):
  u, n = pl.program_id(0), pl.program_id(1)
  tile = lambda ref: ref.at[n, u // nvt, pl.ds((u % nvt) * bv, bv), :]
  plgpu.store(tile(so_ref), plgpu.load(tile(s_ref)) * 1.0001)


def pallas_scale(pool, *, block_v, num_warps):
  """``pool * 1.0001`` in place as the decode kernel's tiles and grid: the copy speed of its
  memory access pattern (ceiling reference). pool ``[N, HV, V, K]``."""
  n, hv, vd, _ = pool.shape
  nvt = vd // block_v
  return (pl.pallas_call(
      functools.partial(_copy_kernel, bv=block_v, nvt=nvt),
      out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
      grid=(hv * nvt, n),
      input_output_aliases={0: 0},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=config.interpret(),
      name="state_scale")(pool),)


def _cfg_name(cfg):
  return " ".join(f"{k}={v}" for k, v in config_diff(cfg, dec.DecodeConfig()).items()) or "default"


def decode_refs(slots):
  """Ceiling references, each ``pool -> (pool,)`` donated: XLA ``pool * 1.0001`` (a fused
  in-place stream), XLA ``pool.at[slots].multiply`` (an in-place scatter) and the Pallas
  ``pallas_scale`` at the decode tilings of ``decode.SWEEP``."""
  refs = {"xla pool*1.0001": lambda p: (p * 1.0001,),
          "xla pool.at[slots].multiply": lambda p: (p.at[slots].multiply(1.0001),)}
  for cfg in dec.SWEEP:
    refs[f"pallas scale block_v={cfg.block_v} num_warps={cfg.num_warps}"] = functools.partial(
        pallas_scale, block_v=cfg.block_v, num_warps=cfg.num_warps)
  return {name: jax.jit(fn, donate_argnums=(0,)) for name, fn in refs.items()}


# Relative errors of the kernel vs the float32 XLA path (same maths): o is rounded to bf16, the
# pool is float32 in both.
DECODE_TOL = (1e-2, 1e-4)


def decode_sweep(left, ns=DECODE_N, h=32):
  """Every tuning in ``decode.SWEEP`` and the ceiling references at the
  largest N (each kernel first checked against the XLA token recurrence on the same inputs:
  output and updated pool), then at the other Ns in the order of that first ranking while
  ``left()`` seconds remain; one table with the best per N."""
  results = {}
  order = list(dec.SWEEP)
  for i, n in enumerate(sorted(ns, reverse=True)):
    args, pool0 = decode_inputs(n, h)
    slots = jnp.arange(n, dtype=jnp.int32)
    o_ref, p_ref = jax.jit(lambda *a: kda_decode(*a, slots=slots, use_qk_l2norm=True,
                                                  implementation="naive"))(
        *(x.astype(jnp.float32) for x in args), pool0)  # float32 maths, o not rounded
    rows = results[n] = []
    for name, fn in decode_refs(slots).items():
      if left() < 6:
        break
      try:
        ms, _ = time_donated(fn, (), jnp.copy(pool0))
        rows.append((name, ms, None, None))
        emit(name=f"decode ref N{n} {name}", ms=round(ms, 4),
             tbps=round(state_tbps(pool0.shape, ms), 2))
      except Exception as e:  # noqa: BLE001
        print(f"decode ref N{n} {name} FAILED", repr(e)[:800], flush=True)
    for cfg in order:
      if left() < 6:
        print(f"decode sweep: time budget spent, N{n} stops before {_cfg_name(cfg)}",
              flush=True)
        break
      try:
        step = jax.jit(lambda *a, cfg=cfg: kda_gpu_decode(*a, slots, cfg),
                       donate_argnums=(5,))
        o, pool = step(*args, jnp.copy(pool0))
        err = (rel(o, o_ref), rel(pool, p_ref))
        ms, _ = time_donated(step, args, pool)
        rows.append((_cfg_name(cfg), ms, *err))
        emit(name=f"decode N{n} {_cfg_name(cfg)}", ms=round(ms, 4),
             tbps=round(state_tbps(pool0.shape, ms), 2), o_err=float(f"{err[0]:.2e}"),
             pool_err=float(f"{err[1]:.2e}"))
        if not (err[0] < DECODE_TOL[0] and err[1] < DECODE_TOL[1]):
          print(f"CHECK FAILED decode N{n} {_cfg_name(cfg)}: o {err[0]:.2e} pool {err[1]:.2e}",
                flush=True)
      except Exception as e:  # noqa: BLE001
        print(f"decode N{n} {_cfg_name(cfg)} FAILED", repr(e)[:1500], flush=True)
    if i == 0:  # the other Ns: fastest tunings of this N first
      ms_of = {r[0]: r[1] for r in rows}
      order.sort(key=lambda c: ms_of.get(_cfg_name(c), float("inf")))
    del args, pool0, o_ref, p_ref
  decode_table(results, h)


def decode_table(results, h):
  """One markdown table of the decode sweep (ms, state TB/s, errors) and the best per N."""
  print("\n| N | kernel / reference | ms | state TB/s | o err | pool err |\n"
        "|---|---|---|---|---|---|")
  best = {}
  for n, rows in sorted(results.items()):
    for name, ms, eo, ep in rows:
      tb = state_tbps((n, h, 128, 128), ms)
      errs = " | ".join("-" if e is None else f"{e:.1e}" for e in (eo, ep))
      print(f"| {n} | {name} | {ms:.4f} | {tb:.2f} | {errs} |", flush=True)
      if eo is not None and eo < DECODE_TOL[0] and ep < DECODE_TOL[1]:
        best[n] = min(best.get(n, (ms, name)), (ms, name))
  for n, (ms, name) in sorted(best.items()):
    ms_of = {r[0]: r[1] for r in results[n]}
    vs = "".join(f", speed {ms_of[r] / ms:.2f}x that of {r}"
                 for r in ("default", "xla pool*1.0001") if r in ms_of)
    print(f"best N{n}: {name}: {ms:.4f} ms, {state_tbps((n, h, 128, 128), ms):.2f} TB/s{vs}",
          flush=True)


def decode_fla(ns):
  for n in ns:
    try:
      ms = time_fla_decode(n)
    except Exception as e:  # noqa: BLE001
      print("fla decode unavailable:", repr(e)[:300], flush=True)
      return
    emit(name=f"fla decode N{n} H32 K128", ms=round(ms, 4),
         tbps=round(2 * n * 32 * 128 * 128 * 4 / ms / 1e9, 2))


def time_fla_decode(n):
  import torch
  from fla.ops.kda import fused_recurrent_kda
  from triton.testing import do_bench
  h, kd = 32, 128
  q, k, v = (torch.randn(1, n, h, kd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
  g = -torch.rand(1, n, h, kd, device="cuda")
  beta = torch.rand(1, n, h, device="cuda", dtype=torch.bfloat16)
  h0 = torch.randn(n, h, kd, kd, device="cuda")
  cu = torch.arange(n + 1, device="cuda", dtype=torch.long)
  f = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
  return do_bench(f, warmup=25, rep=100, return_mode="median")


def main():
  t0 = time.perf_counter()
  budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 75.0
  left = lambda: budget - (time.perf_counter() - t0)
  print("jax", jax.__version__, jax.devices(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        flush=True)
  ns = (tuple(int(x) for x in sys.argv[sys.argv.index("--ns") + 1].split(","))
        if "--ns" in sys.argv else DECODE_N)
  h = int(sys.argv[sys.argv.index("--heads") + 1]) if "--heads" in sys.argv else 32
  decode_sweep(left, ns, h)
  if "--peers" in sys.argv:  # fla's fused_recurrent_kda in the same run
    decode_fla(ns)
  print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
  main()
