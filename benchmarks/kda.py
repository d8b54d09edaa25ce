"""KDA on one GPU: check the Pallas kernels against the XLA references, then time them next to
fla ``chunk_kda`` / ``fused_recurrent_kda`` (torch + triton), jla ``kda`` (Mosaic GPU) when
importable, and the project's XLA chunked path (``implementation="chunked"``), in the same run.

  python3 benchmarks/kda.py              # everything (the H200 run)
  python3 benchmarks/kda.py --quick      # small shapes only
  python3 benchmarks/kda.py --ours-only  # no peers
  python3 benchmarks/kda.py --no-decode  # training/prefill shapes only
  python3 benchmarks/kda.py --sweep      # also the chunk-local kernels at other warp counts
  python3 benchmarks/kda.py --check      # the checks, then that sweep only

Per shape the order is ours, jla, XLA chunked, fla, and every row is written to
``$OUT/kda_bench.json`` as soon as it is measured, so a run cut short keeps what it measured.

Training/prefill shapes from ../shared/PERF.md: q, k, v ``[B, T, H, 128]`` bf16, bounded
(safe) gate with lower bound -5 computed in the kernel from the raw projection, L2 norm and beta
sigmoid in the kernel (fla's configuration). jla gets the precomputed log decay and beta (its
API), with its in-kernel L2 norm. Decode: one token for N requests, H=32, K=V=128, float32
state pool updated in place; reported as state traffic (read + write) per second.
JAX times: median over repeats of 5 back-to-back calls; fla times: triton's do_bench median.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda import kda, kda_decode  # noqa: E402
from pallas_kernels.kda import gpu as kda_gpu  # noqa: E402
from timing import Rows, median_ms as jtime  # noqa: E402

SHAPES = [(1, 16384, 32, 128), (4, 4096, 32, 128), (1, 65536, 16, 128)]
DECODE_N = (64, 256)
LB = -5.0
_ROWS = Rows("kda_bench.json")
ROWS = _ROWS.rows


def emit(**r):
  """Prints one result row and rewrites $OUT/kda_bench.json (a run cut short keeps its rows)."""
  _ROWS.emit(r)


def inputs(b, t, h, kd, seed=0, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 7)
  q = jax.random.normal(ks[0], (b, t, h, kd), dtype)
  k = jax.random.normal(ks[1], (b, t, h, kd), dtype)
  v = jax.random.normal(ks[2], (b, t, h, kd), dtype)
  f = jax.random.normal(ks[3], (b, t, h, kd), dtype)
  beta = jax.random.normal(ks[4], (b, t, h), dtype)
  a_log = 0.3 * jax.random.normal(ks[5], (h,), jnp.float32)
  dt_bias = 0.3 * jax.random.normal(ks[6], (h * kd,), jnp.float32)
  return q, k, v, f, beta, a_log, dt_bias


def ours(q, k, v, f, beta, a_log, dt_bias, segment_ids=None, initial_state=None,
         impl="pallas_gpu"):
  return kda(q, k, v, f, beta, use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias, gate="bounded",
             lower_bound=LB, beta_is_logit=True, segment_ids=segment_ids,
             initial_state=initial_state, output_final_state=True, implementation=impl)


def rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def check(decode=True):
  """bf16 kernel vs float32 naive recurrence: outputs, final state, all gradients (and the
  decode kernel vs the XLA path if ``decode``)."""
  b, t, h, kd = 2, 600, 4, 128
  q, k, v, f, beta, a_log, dt_bias = inputs(b, t, h, kd, seed=1)
  seg = jnp.concatenate([jnp.zeros((b, 250), jnp.int32), jnp.ones((b, 100), jnp.int32),
                         jnp.full((b, 250), 2, jnp.int32)], 1)
  s0 = jax.random.normal(jax.random.key(9), (b, h, kd, kd), jnp.float32)
  args = (q, k, v, f, beta, a_log, dt_bias, s0)

  def run(impl, *a):
    *a, s = a
    return ours(*a, segment_ids=seg, initial_state=s, impl=impl)

  def loss(impl, *a):
    o, s = run(impl, *a)
    return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(kd))) + jnp.sum(s * 0.01)

  up = tuple(x.astype(jnp.float32) for x in args)
  o1, s1 = jax.jit(lambda *a: run("pallas_gpu", *a))(*args)
  o2, s2 = jax.jit(lambda *a: run("naive", *a))(*up)
  g1 = jax.jit(jax.grad(lambda *a: loss("pallas_gpu", *a), argnums=tuple(range(8))))(*args)
  g2 = jax.jit(jax.grad(lambda *a: loss("naive", *a), argnums=tuple(range(8))))(*up)
  errs = {"o": rel(o1, o2), "state": rel(s1, s2)}
  errs.update({f"d{n}": rel(x, y) for n, x, y in
               zip("q k v f beta A_log dt_bias s0".split(), g1, g2)})
  emit(name="check pallas_gpu bf16 vs naive f32 (B2 T600 H4 K128, 3 segments)",
       **{k_: round(v_, 5) for k_, v_ in errs.items()})
  bad = {k_: v_ for k_, v_ in errs.items() if not v_ < 3e-2}
  if bad:
    print("CHECK FAILED", bad, flush=True)
  if not decode:
    return
  # decode vs XLA path, non-contiguous slots, 3 tokens
  n, tn = 8, 3
  qd, kdd, vd, fd, bd, _, _ = inputs(n, tn, h, kd, seed=2)
  pool = jax.random.normal(jax.random.key(3), (2 * n, h, kd, kd), jnp.float32)
  slots = jnp.arange(n, dtype=jnp.int32)[::-1] * 2
  kw = dict(slots=slots, use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias, gate="bounded",
            beta_is_logit=True)
  od1, p1 = jax.jit(lambda *a: kda_decode(*a, implementation="pallas_gpu", **kw))(
      qd, kdd, vd, fd, bd, pool)
  od2, p2 = kda_decode(qd, kdd, vd, fd, bd, pool, implementation="naive", **kw)
  emit(name="check decode vs naive (N8 Tn3)", o=round(rel(od1, od2), 5), pool=round(rel(p1, p2), 6))


def time_ours(shape, impl="pallas_gpu"):
  b, t, h, kd = shape
  q, k, v, f, beta, a_log, dt_bias = inputs(b, t, h, kd)
  fwd = jax.jit(lambda *a: ours(*a, impl=impl)[0])
  loss = lambda *a: jnp.sum(ours(*a, impl=impl)[0].astype(jnp.float32))
  fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6)))
  args = (q, k, v, f, beta, a_log, dt_bias)
  return {"fwd": jtime(fwd, *args), "fwdbwd": jtime(fb, *args, reps=7)}


def time_chunked(shape):
  """The XLA chunked path (``implementation="chunked"``), same inputs and fusions."""
  return time_ours(shape, impl="chunked")


def _cfg(kd):
  return kda_gpu._Config(scale=kd ** -0.5, chunk=64, use_qk_l2norm=True, gate="bounded",
                         lower_bound=LB, beta_is_logit=True, dense_diag=True, dtype="bfloat16")


def time_parts(shape, recurrences=True):
  """Per-kernel breakdown: chunk-local forward (prep) and backward (prep_bwd) kernels, and
  optionally the sequential passes (recur_fwd_store, recur_bwd)."""
  b, t, h, kd = shape
  q, k, v, f, beta, a_log, dt_bias = inputs(b, t, h, kd)
  cfg = _cfg(kd)
  seg = jnp.zeros((b, t), jnp.int32)
  args = (q, k, v, f, beta, a_log, dt_bias.reshape(h, kd))
  prep = jax.jit(lambda *a: kda_gpu._prepare(cfg, *a, seg, t))
  res = {"prep": jtime(prep, *args)}
  pre = prep(*args)
  s0 = jnp.zeros((b, h, kd, kd), jnp.float32)
  rec = jax.jit(lambda *p: kda_gpu._recurrence_fwd(cfg, *p, s0, jnp.bfloat16, store=True))
  _, _, hs, vn = rec(*pre)
  do = jax.random.normal(jax.random.key(7), (b, t, h, kd), jnp.bfloat16)
  w, u, qg, aqk, kdec, gc = pre
  recb = jax.jit(lambda *p: kda_gpu._recurrence_bwd(cfg, *p))
  dvn, dh, _ = recb(do, qg, aqk, kdec, w, gc, s0)
  if recurrences:
    res["recur_fwd_store"] = jtime(rec, *pre)
    res["recur_bwd"] = jtime(recb, do, qg, aqk, kdec, w, gc, s0)
  pb = jax.jit(lambda *a: kda_gpu._prepare_bwd(cfg, *a, t))
  res["prep_bwd"] = jtime(pb, *args, seg, hs, dh, vn, dvn, do, reps=7, inner=3)
  return res


def prep_sweep(shape, warps_list=((8, 4), (2, 16))):
  """Chunk-local kernels at other (forward, backward) warp counts of the dense path."""
  res = {}
  default = kda_gpu.DENSE_WARPS
  for warps in warps_list:
    kda_gpu.DENSE_WARPS = warps
    r = time_parts(shape, recurrences=False)
    res[f"prep_w{warps[0]}"], res[f"prep_bwd_w{warps[1]}"] = r["prep"], r["prep_bwd"]
  kda_gpu.DENSE_WARPS = default
  return res


def time_jla(shape):
  from jla.ops.mosaic_gpu.kda import kda as jla_kda
  b, t, h, kd = shape
  q, k, v, f, beta, _, _ = inputs(b, t, h, kd)
  g = LB * jax.nn.sigmoid(f.astype(jnp.float32))
  bb = jax.nn.sigmoid(beta.astype(jnp.float32)).astype(jnp.bfloat16)
  fwd = jax.jit(lambda *a: jla_kda(*a, use_qk_l2norm=True)[0])
  loss = lambda *a: jnp.sum(jla_kda(*a, use_qk_l2norm=True)[0].astype(jnp.float32))
  fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  return {"fwd": jtime(fwd, q, k, v, g, bb), "fwdbwd": jtime(fb, q, k, v, g, bb, reps=7)}


def time_fla(shape):
  import torch
  from fla.ops.kda import chunk_kda
  from triton.testing import do_bench
  b, t, h, kd = shape
  torch.manual_seed(0)
  mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
  q, k, v, g = (mk(b, t, h, kd) for _ in range(4))
  beta = mk(b, t, h)
  kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=torch.zeros(h, device="cuda"),
            dt_bias=torch.zeros(h * kd, device="cuda"), safe_gate=True, lower_bound=LB)
  f = lambda: chunk_kda(q, k, v, g, beta, **kw)[0]
  r = {"fwd": do_bench(f, warmup=25, rep=100, return_mode="median")}
  do = torch.randn_like(f())

  def fb():
    chunk_kda(q, k, v, g, beta, **kw)[0].backward(do)
  r["fwdbwd"] = do_bench(fb, warmup=10, rep=100, return_mode="median",
                         grad_to_none=[q, k, v, g, beta])
  del q, k, v, g, beta, do
  torch.cuda.empty_cache()
  return r


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


def time_decode(n, block_v=32, num_warps=4):
  h, kd = 32, 128
  q, k, v, f, beta, a_log, dt_bias = inputs(n, 1, h, kd)
  g = -jax.random.uniform(jax.random.key(5), (n, 1, h, kd), jnp.float32)
  beta = jax.nn.sigmoid(beta)
  pool = jax.random.normal(jax.random.key(6), (n, h, kd, kd), jnp.float32)
  slots = jnp.arange(n, dtype=jnp.int32)
  step = jax.jit(lambda q, k, v, g, b, s: kda_gpu_decode(q, k, v, g, b, s, slots, block_v,
                                                           num_warps), donate_argnums=(5,))
  o, pool = step(q, k, v, g, beta, pool)
  jax.block_until_ready(pool)
  ts = []
  for _ in range(15):
    t0 = time.perf_counter()
    for _ in range(20):
      o, pool = step(q, k, v, g, beta, pool)
    jax.block_until_ready(pool)
    ts.append((time.perf_counter() - t0) / 20)
  ts.sort()
  ms = ts[len(ts) // 2] * 1e3
  return ms, 2 * n * h * kd * kd * 4 / ms / 1e9


def kda_gpu_decode(q, k, v, g, b, s, slots, block_v, num_warps):
  from pallas_kernels.kda import decode
  return decode._decode_gpu(q, k, v, g, b, s, slots, scale=q.shape[-1] ** -0.5,
                            use_qk_l2norm=True, A_log=None, dt_bias=None, gate=None,
                            lower_bound=LB, beta_is_logit=False, block_v=block_v,
                            num_warps=num_warps)


def main():
  quick = "--quick" in sys.argv
  shapes = [(1, 2048, 8, 128)] if quick else SHAPES
  print("jax", jax.__version__, jax.devices(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        flush=True)
  try:
    check(decode="--no-decode" not in sys.argv)
  except Exception as e:  # noqa: BLE001 - the timings below are still worth having
    print("CHECK ERROR", repr(e)[:2000], flush=True)
  if "--check" in sys.argv:
    emit(name="prep sweep B1 T16384 H32 K128", **{k: round(v, 4) for k, v in
                                                  prep_sweep(SHAPES[0]).items()})
    return
  runners = [("ours", time_ours), ("jla", time_jla), ("chunked", time_chunked), ("fla", time_fla)]
  if "--ours-only" in sys.argv:
    runners = runners[:1]
  for i, shape in enumerate(shapes):
    tag = "B{} T{} H{} K{}".format(*shape)
    for name, fn in runners:
      try:
        emit(name=f"{name} {tag}", **{k: round(v, 4) for k, v in fn(shape).items()})
      except Exception as e:  # noqa: BLE001
        print(f"{name} {tag} FAILED", repr(e)[:1500], flush=True)
    if i == 0:
      emit(name=f"ours parts {tag}", **{k: round(v, 4) for k, v in time_parts(shape).items()})
  table()
  if "--no-decode" not in sys.argv:
    decode(fla="--ours-only" not in sys.argv)
  if "--sweep" in sys.argv:
    emit(name=f"prep sweep {'B{} T{} H{} K{}'.format(*shapes[0])}",
         **{k: round(v, 4) for k, v in prep_sweep(shapes[0]).items()})


def decode(fla):
  for n in DECODE_N:
    for bv, nw in ((64, 4), (128, 4), (128, 8), (64, 8)):
      try:
        ms, tbps = time_decode(n, bv, nw)
        emit(name=f"ours decode N{n} H32 K128 bv{bv} w{nw}", ms=round(ms, 4), tbps=round(tbps, 2))
      except Exception as e:  # noqa: BLE001
        print(f"decode N{n} bv{bv} FAILED", repr(e)[:1500], flush=True)
    try:
      ms = time_fla_decode(n) if fla else None
    except Exception as e:  # noqa: BLE001
      print("fla decode unavailable:", repr(e)[:300], flush=True)
      ms = None
    if ms:
      emit(name=f"fla decode N{n} H32 K128", ms=round(ms, 4),
           tbps=round(2 * n * 32 * 128 * 128 * 4 / ms / 1e9, 2))


def table():
  by = {r["name"]: r for r in ROWS}
  print("\n| shape | pass | ours ms | fla ms | jla ms | XLA chunked ms | fla/ours | jla/ours |"
        " chunked/ours |")
  print("|---|---|---|---|---|---|---|---|---|")
  for shape in SHAPES + [(1, 2048, 8, 128)]:
    tag = "B{} T{} H{} K{}".format(*shape)
    o = by.get(f"ours {tag}")
    if not o:
      continue
    for p in ("fwd", "fwdbwd"):
      peer = [by.get(f"{n} {tag}", {}).get(p) for n in ("fla", "jla", "chunked")]
      ratio = lambda x: f"{x / o[p]:.2f}x" if x else "-"
      cells = " | ".join(f"{x:.3f}" if x else "-" for x in peer)
      print(f"| {tag} | {p} | {o[p]:.3f} | {cells} | " + " | ".join(ratio(x) for x in peer) + " |",
            flush=True)


if __name__ == "__main__":
  main()
