"""MoE compute path on one GPU: checks against the XLA reference, then times.

1. Checks (bf16, relative Frobenius error vs a float32 XLA reference): our grouped matmul forward,
   d_lhs and d_rhs with skewed group sizes (empty groups, rows past the sum, M not a multiple of 8),
   and ``expert_mlp`` Pallas vs XLA (values and gradients).
2. Grouped matmul at the PERF.md shapes (equal groups, bf16), forward and forward+backward:
   ours (and a few tilings, forward), ``jax.lax.ragged_dot`` and jla's Mosaic GPU ``ragged_dot``
   when importable.
3. A K3-shaped routed MoE layer (d 7168, latent 3584, expert width 3072, top-16 of E local
   experts, 16K tokens, SiTU-GLU): router, latent down projection, ``expert_mlp``, RMSNorm, latent
   up projection; forward+backward (gradients of x and every weight), ours vs XLA.

Timing: median wall time around ``block_until_ready`` (as ``shared/bench/bench_jla_moe.py``).
Run: ``python benchmarks/moe.py [--quick] [--no-xla] [--skip checks,gmm,layer]``; rows are printed as JSON and written to
``$OUT/moe.json`` when OUT is set.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.glu import situ_glu
from pallas_kernels import moe
from pallas_kernels.moe import gpu, pallas
from timing import Rows, median_ms

SHAPES = [(64, 32768, 2048, 1024), (32, 65536, 3584, 6144), (8, 32768, 1024, 512)]  # E, M, K, N
CONFIGS = [(128, 128, 64, 4), (128, 128, 64, 6), (64, 256, 64, 4), (128, 128, 128, 3)]
_ROWS = Rows("moe.json")


def emit(**row):
  _ROWS.emit(row)


def bench(fn, *args, n=10):
  """Median milliseconds of ``n`` synchronised calls."""
  return median_ms(fn, *args, reps=n, inner=1)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fwd_bwd(f):
  """``(x, w, gs, dy) -> (d_x, d_w)`` of ``sum(f(x, w, gs) * dy)``."""
  def loss(x, w, gs, dy):
    return jnp.sum(f(x, w, gs).astype(jnp.float32) * dy)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def checks():
  k0, k1, k2 = jax.random.split(jax.random.key(7), 3)
  m, k, n = 3001, 512, 384
  gs = jnp.array([0, 900, 3, 0, 1200, 64, 1, 700], jnp.int32)  # sum 2868 < m
  x = jax.random.normal(k0, (m, k), jnp.bfloat16)
  w = jax.random.normal(k1, (gs.shape[0], k, n), jnp.bfloat16) / 16
  dy = jax.random.normal(k2, (m, n), jnp.float32)
  xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
  ours = jax.jit(lambda x, w, gs: moe.gmm(x, w, gs, implementation="pallas_gpu"))
  ref = jax.jit(lambda x, w, gs: moe.gmm(x, w, gs, implementation="xla",
                                         preferred_element_type=jnp.float32))
  emit(check="gmm fwd", rel_err=rel(ours(x, w, gs), ref(xf, wf, gs)))
  tail = np.asarray(ours(x, w, gs)[int(gs.sum()):], np.float32)
  emit(check="gmm rows past sum are zero", ok=bool(np.all(tail == 0)))
  gx, gw = fwd_bwd(lambda x, w, gs: moe.gmm(x, w, gs, implementation="pallas_gpu"))(x, w, gs, dy)
  rx, rw = fwd_bwd(lambda x, w, gs: moe.gmm(x, w, gs, implementation="xla"))(xf, wf, gs, dy)
  emit(check="gmm d_lhs", rel_err=rel(gx, rx))
  emit(check="gmm d_rhs", rel_err=rel(gw, rw))

  t, d, f, e, top = 1000, 256, 192, 8, 4
  ks = jax.random.split(jax.random.key(8), 5)
  xt = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  ids = jnp.argsort(jax.random.normal(ks[1], (t, e)), axis=1)[:, :top]
  wts = jax.random.uniform(ks[2], (t, top), jnp.float32)
  wgu = (jax.random.normal(ks[3], (e, d, 2 * f), jnp.float32) / 16).astype(jnp.bfloat16)
  wdn = (jax.random.normal(ks[4], (e, f, d), jnp.float32) / 16).astype(jnp.bfloat16)

  def mlp_loss(impl):
    def loss(xt, wts, wgu, wdn):
      y = moe.expert_mlp(xt, ids, wts, wgu, wdn, situ_glu, implementation=impl)
      return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(d, dtype=jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

  (lo, go), (lr, gr) = mlp_loss("pallas_gpu")(xt, wts, wgu, wdn), mlp_loss("xla")(xt, wts, wgu, wdn)
  emit(check="expert_mlp value", rel_err=rel(lo, lr))
  for name, a, b in zip(("d_x", "d_weights", "d_w_gate_up", "d_w_down"), go, gr):
    emit(check=f"expert_mlp {name}", rel_err=rel(a, b))


def gmm_table(quick: bool, no_xla: bool):
  try:
    from jla.ops.mosaic_gpu.ragged_dot import ragged_dot as jla_rd
  except Exception as err:  # noqa: BLE001 - report and time the rest
    print("jla import failed:", repr(err)[:300])
    jla_rd = None
  for e, m, k, n in SHAPES:
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (e, k, n), jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.float32)
    gs = jnp.full((e,), m // e, jnp.int32)
    flops = 2 * m * k * n
    shape = f"E{e} M{m} K{k} N{n}"
    impls = {"ours": lambda x, w, gs: pallas.gmm(x, w, gs, backend="gpu"),
             "xla": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)}
    if no_xla:
      del impls["xla"]
    if jla_rd is not None:
      impls["jla"] = lambda x, w, gs: jla_rd(x, w, gs)
    reps = {"xla": 3 if flops > 1e12 else 10}
    for name, f in impls.items():
      try:
        ms = bench(jax.jit(f), x, w, gs, n=reps.get(name, 20))
        emit(gmm=shape, impl=name, mode="fwd", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
        ms = bench(fwd_bwd(f), x, w, gs, dy, n=reps.get(name, 20))
        emit(gmm=shape, impl=name, mode="fwd+bwd", ms=round(ms, 3), tflops=round(3 * flops / ms / 1e9, 1))
      except Exception as err:  # noqa: BLE001
        emit(gmm=shape, impl=name, error=repr(err)[:300])
    if not quick:
      for cfg in CONFIGS:
        try:
          f = jax.jit(lambda x, w, gs, cfg=cfg: gpu.gmm(x, w, gs, config=cfg))
          ms = bench(f, x, w, gs, n=20)
          emit(gmm=shape, impl=f"ours {cfg}", mode="fwd", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
        except Exception as err:  # noqa: BLE001
          emit(gmm=shape, impl=f"ours {cfg}", error=repr(err)[:300])
    f = jax.jit(lambda x, w, gs: gpu.gmm(x, w, gs, persistent=False))
    ms = bench(f, x, w, gs, n=20)
    emit(gmm=shape, impl="ours per-item pipelines", mode="fwd", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
    if not quick:
      f = jax.jit(lambda x, dy, gs: gpu.tgmm(x, dy.astype(jnp.bfloat16), gs))
      ms = bench(f, x, dy, gs, n=20)
      emit(gmm=shape, impl="ours tgmm (d_rhs)", mode="bwd part", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))


def moe_layer(x, router, w_in, w_out, w_gate_up, w_down, norm, *, top, impl):
  """K3 routed MoE: sigmoid router (float32) -> top-k, renormalised weights; latent down projection;
  experts; RMSNorm; latent up projection. x [T, d] -> [T, d]."""
  scores = jax.nn.sigmoid(jnp.dot(x, router, preferred_element_type=jnp.float32))
  top_scores, ids = jax.lax.top_k(scores, top)
  weights = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
  y = moe.expert_mlp(x @ w_in, ids, weights, w_gate_up, w_down, situ_glu, implementation=impl)
  yf = y.astype(jnp.float32)
  y = (yf * jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + 1e-6) * norm).astype(x.dtype)
  return y @ w_out


def layer_table(no_xla: bool):
  t, d, lat, f, e, top = 16384, 7168, 3584, 3072, 32, 16
  ks = jax.random.split(jax.random.key(1), 8)
  s = lambda fan_in: 1.0 / np.sqrt(fan_in)  # noqa: E731
  x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  params = (
      (jax.random.normal(ks[1], (d, e), jnp.float32) * s(d)).astype(jnp.bfloat16),
      (jax.random.normal(ks[2], (d, lat), jnp.float32) * s(d)).astype(jnp.bfloat16),
      (jax.random.normal(ks[3], (lat, d), jnp.float32) * s(lat)).astype(jnp.bfloat16),
      (jax.random.normal(ks[4], (e, lat, 2 * f), jnp.float32) * s(lat)).astype(jnp.bfloat16),
      (jax.random.normal(ks[5], (e, f, lat), jnp.float32) * s(f)).astype(jnp.bfloat16),
      jnp.ones((lat,), jnp.float32),
  )
  dy = jax.random.normal(ks[6], (t, d), jnp.bfloat16)
  expert_flops = 2 * t * top * (lat * 2 * f + f * lat)
  flops = expert_flops + 2 * t * d * (e + 2 * lat)
  shape = f"T{t} d{d} latent{lat} F{f} E{e} top{top}"

  def step(impl):
    def loss(x, *p):
      return jnp.sum(moe_layer(x, *p, top=top, impl=impl).astype(jnp.float32) * dy)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))

  values = {}
  for impl in ("pallas_gpu",) if no_xla else ("pallas_gpu", "xla"):
    try:
      fn = step(impl)
      values[impl] = fn(x, *params)
      ms = bench(fn, x, *params, n=3 if impl == "xla" else 10)
      emit(layer=shape, impl=impl, mode="fwd+bwd", ms=round(ms, 2), tflops=round(3 * flops / ms / 1e9, 1),
           expert_share=round(expert_flops / flops, 3))
    except Exception as err:  # noqa: BLE001
      emit(layer=shape, impl=impl, error=repr(err)[:300])
  if len(values) == 2:
    (va, ga), (vb, gb) = values["pallas_gpu"], values["xla"]
    emit(check="layer pallas vs xla loss", rel_err=rel(va, vb))
    emit(check="layer pallas vs xla grads (max over args)", rel_err=max(rel(a, b) for a, b in zip(ga, gb)))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="no tiling sweep, no tgmm timing")
  parser.add_argument("--skip", default="", help="comma list of: checks, gmm, layer")
  parser.add_argument("--no-xla", action="store_true", help="do not time jax.lax.ragged_dot")
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  skip = set(args.skip.split(","))
  if "checks" not in skip:
    try:
      checks()
    except Exception as err:  # noqa: BLE001 - still time the rest
      emit(check="failed", error=repr(err)[:500])
  if "gmm" not in skip:
    gmm_table(args.quick, args.no_xla)
  if "layer" not in skip:
    layer_table(args.no_xla)


if __name__ == "__main__":
  main()
