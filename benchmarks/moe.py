"""MoE compute path on one GPU: checks against the XLA reference, then times.

1. Checks (bf16, relative Frobenius error vs a float32 XLA reference): our grouped matmul forward,
   d_lhs and d_rhs with skewed group sizes (empty groups, rows past the sum, M not a multiple of 8),
   and ``expert_mlp`` Pallas vs XLA (values and gradients).
2. Grouped matmul at the PERF.md shapes (equal groups, bf16), forward and forward+backward:
   ours, ``jax.lax.ragged_dot`` and jla's Mosaic GPU ``ragged_dot``
   when importable.
3. A K3-shaped routed MoE layer (d 7168, latent 3584, expert width 3072, top-16 of E local
   experts, 16K tokens, SiTU-GLU): router, latent down projection, ``expert_mlp``, RMSNorm, latent
   up projection; forward+backward (gradients of x and every weight), ours vs XLA.

``--sweep`` instead (under 2 minutes on an H200 with compiles; it starts no new work after
``--budget`` seconds, default 100): the grouped-matmul checks of 1.; at the three shapes ours (the
:func:`gpu.default_tiles` heuristic) and jla forward, with the row-tile table and the kernel timed
apart; ours and jla forward+backward; then each tiling variant of :data:`VARIANTS`, first checked
on skewed groups, timed forward beside jla; ends with the winning tiling per shape. Sweep timings
are medians of batches of 5 back-to-back calls (launch overhead hidden).

Timing: median wall time around ``block_until_ready`` (as ``shared/bench/bench_jla_moe.py``).
Run: ``python benchmarks/moe.py [--quick] [--no-xla] [--skip checks,gmm,layer] [--sweep]``; rows
are printed as JSON and written to ``$OUT/moe.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.glu import glu_packed
from pallas_kernels import moe
from pallas_kernels.moe import gpu, pallas
from timing import Rows, median_ms, rel_err

SITU = functools.partial(glu_packed, kind="situ")

SHAPES = [(64, 32768, 2048, 1024), (32, 65536, 3584, 6144), (8, 32768, 1024, 512)]  # E, M, K, N
# Tiling variants of the sweep, each a change to the heuristic's tiling at the shape, in order of
# interest (the two-consumer kernel, new and unchecked on a GPU, after the single-consumer ones).
VARIANTS = {
    "heuristic": lambda t: t,
    "4 stages": lambda t: t._replace(steps=4),
    "band 8": lambda t: t._replace(band=8),
    "2 consumers, 3 stages": lambda t: t._replace(consumers=2, steps=3),
    "2 consumers, 3 stages, band 8": lambda t: t._replace(consumers=2, steps=3, band=8),
    "6 stages": lambda t: t._replace(steps=6),
    "K step 128, 3 stages": lambda t: t._replace(block_k=128, steps=3),
}
_ROWS = Rows("moe.json")


def emit(**row):
  _ROWS.emit(row)


def bench(fn, *args, n=10, inner=1):
  """Median milliseconds per call of ``n`` synchronised batches of ``inner`` calls."""
  return median_ms(fn, *args, reps=n, inner=inner)


def fwd_bwd(f):
  """``(x, w, gs, dy) -> (loss, (d_x, d_w))`` of ``loss = sum(f(x, w, gs) * dy)``: the value
  keeps the forward product in the timing (with ``jax.grad`` alone XLA drops it, since the
  backward of a product needs only its inputs; fwd+bwd rows before 2026-12-01 timed the
  backward alone, for every implementation alike)."""
  def loss(x, w, gs, dy):
    return jnp.sum(f(x, w, gs).astype(jnp.float32) * dy)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def gmm_checks():
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
  emit(check="gmm fwd", rel_err=rel_err(ours(x, w, gs), ref(xf, wf, gs)))
  tail = np.asarray(ours(x, w, gs)[int(gs.sum()):], np.float32)
  emit(check="gmm rows past sum are zero", ok=bool(np.all(tail == 0)))
  _, (gx, gw) = fwd_bwd(lambda x, w, gs: moe.gmm(x, w, gs, implementation="pallas_gpu"))(
      x, w, gs, dy)
  _, (rx, rw) = fwd_bwd(lambda x, w, gs: moe.gmm(x, w, gs, implementation="xla"))(xf, wf, gs, dy)
  emit(check="gmm d_lhs", rel_err=rel_err(gx, rx))
  emit(check="gmm d_rhs", rel_err=rel_err(gw, rw))


def mlp_checks():
  t, d, f, e, top = 1000, 256, 192, 8, 4
  ks = jax.random.split(jax.random.key(8), 5)
  xt = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  ids = jnp.argsort(jax.random.normal(ks[1], (t, e)), axis=1)[:, :top]
  wts = jax.random.uniform(ks[2], (t, top), jnp.float32)
  wgu = (jax.random.normal(ks[3], (e, d, 2 * f), jnp.float32) / 16).astype(jnp.bfloat16)
  wdn = (jax.random.normal(ks[4], (e, f, d), jnp.float32) / 16).astype(jnp.bfloat16)

  def mlp_loss(impl):
    def loss(xt, wts, wgu, wdn):
      y = moe.expert_mlp(xt, ids, wts, wgu, wdn, SITU, implementation=impl)
      return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(d, dtype=jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

  (lo, go), (lr, gr) = mlp_loss("pallas_gpu")(xt, wts, wgu, wdn), mlp_loss("xla")(xt, wts, wgu, wdn)
  emit(check="expert_mlp value", rel_err=rel_err(lo, lr))
  for name, a, b in zip(("d_x", "d_weights", "d_w_gate_up", "d_w_down"), go, gr):
    emit(check=f"expert_mlp {name}", rel_err=rel_err(a, b))


def gmm_table(quick: bool, no_xla: bool):
  jla_rd = jla_ragged_dot()
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
      f = jax.jit(lambda x, dy, gs: gpu.tgmm(x, dy.astype(jnp.bfloat16), gs))
      ms = bench(f, x, dy, gs, n=20)
      emit(gmm=shape, impl="ours tgmm (d_rhs)", mode="bwd part", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))


def sweep(budget: float, shapes=SHAPES, fwd_bwd_too: bool = True):
  """Grouped-matmul checks, then at ``shapes``: ours vs jla forward (with the row-tile table
  and the kernel timed apart), the tiling variants forward, ours vs jla forward+backward (unless
  not ``fwd_bwd_too``). Starts no new work after ``budget`` seconds; prints the winning tiling
  per shape."""
  t0 = time.perf_counter()
  jla_rd = jla_ragged_dot()
  over = lambda: time.perf_counter() - t0 > budget  # noqa: E731
  try:
    gmm_checks()
  except Exception as err:  # noqa: BLE001 - still time the rest
    emit(check="failed", error=repr(err)[:500])
  # 64 groups of 0-89 rows: the heuristic's 64-row tiles
  variant_check("heuristic, small groups", lambda t: t, sizes=tuple(i * 37 % 90 for i in range(64)))
  impls = {"ours": lambda x, w, gs: pallas.gmm(x, w, gs, backend="gpu")}
  if jla_rd is not None:
    impls["jla"] = lambda x, w, gs: jla_rd(x, w, gs)
  data, jla_ms, results = {}, {}, {}
  for e, m, k, n in shapes:  # phase 1: the heuristic vs jla, forward
    shape = f"E{e} M{m} K{k} N{n}"
    if over():
      emit(gmm=shape, skipped="budget")
      continue
    ks = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (e, k, n), jnp.bfloat16)
    gs = jnp.full((e,), m // e, jnp.int32)
    ref = jax.jit(lambda x, w: jnp.einsum("egk,ekn->egn", x.reshape(e, m // e, k), w,
                                          preferred_element_type=jnp.float32).reshape(m, n))(x, w)
    data[shape] = (x, w, gs, ref)
    flops = 2 * m * k * n
    tiles = gpu.default_tiles(m, e, k, n)
    emit(gmm=shape, heuristic=str(tiles))
    for name, f in impls.items():
      try:
        fwd = jax.jit(f)
        err = rel_err(fwd(x, w, gs), ref)
        ms = bench(fwd, x, w, gs, n=10, inner=5)
      except Exception as exc:  # noqa: BLE001
        emit(gmm=shape, impl=name, error=repr(exc)[:300])
        continue
      emit(gmm=shape, impl=name, mode="fwd", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
           rel_err=err)
      if name == "jla":
        jla_ms[shape] = ms
    table = jax.jit(lambda gs: gpu.row_tiles(gs, m, tiles.block_m))
    emit(gmm=shape, impl="ours row-tile table alone", ms=round(bench(table, gs, n=10, inner=5), 4))
    tab, count = table(gs)
    search = jax.jit(lambda a, t: jnp.searchsorted(a, t, side="right"))  # what the old table ran
    emit(gmm=shape, impl="jnp.searchsorted of the tiles over the groups (the previous table's search)",
         ms=round(bench(search, jnp.arange(e + 1, dtype=jnp.int32),
                        jnp.arange(tab.shape[1], dtype=jnp.int32), n=10, inner=5), 4))
    kernel = jax.jit(lambda x, w, tab, count: gpu.gmm_tiled(x, w, tab, count, transpose_rhs=False,
                                                             config=tiles))
    ms = bench(kernel, x, w, tab, count, n=10, inner=5)
    emit(gmm=shape, impl="ours kernel on a prebuilt table", mode="fwd", ms=round(ms, 3),
         tflops=round(flops / ms / 1e9, 1))
  for shape, (x, w, gs, _) in data.items():  # phase 2: forward+backward, ours and jla
    m, k, n = x.shape[0], x.shape[1], w.shape[2]
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.float32)
    for name, f in impls.items():
      if over() or not fwd_bwd_too:
        emit(gmm=shape, impl=name, mode="fwd+bwd", skipped="budget" if over() else "--no-bwd")
        continue
      try:
        ms = bench(fwd_bwd(f), x, w, gs, dy, n=10, inner=5)
        emit(gmm=shape, impl=name, mode="fwd+bwd", ms=round(ms, 3),
             tflops=round(6 * m * k * n / ms / 1e9, 1))
      except Exception as exc:  # noqa: BLE001
        emit(gmm=shape, impl=name, mode="fwd+bwd", error=repr(exc)[:300])
  for shape, (x, w, gs, _) in data.items():  # phase 3: jla again, then the variants beside it
    if shape in jla_ms:
      jla_ms[shape] = bench(jax.jit(impls["jla"]), x, w, gs, n=10, inner=5)
      emit(gmm=shape, impl="jla", mode="fwd (phase 3)", ms=round(jla_ms[shape], 3))
  for name, vary in VARIANTS.items():  # the budget cuts the last ones; a variant that fails its
    if over() or not variant_check(name, vary):  # check on skewed groups is not timed
      emit(variant=name, skipped="budget" if over() else "failed its check")
      continue
    for shape, (x, w, gs, ref) in data.items():
      e, (m, k), n = w.shape[0], x.shape, w.shape[2]
      tiles = vary(gpu.default_tiles(m, e, k, n))
      if over():
        emit(gmm=shape, variant=name, skipped="budget")
        continue
      try:
        tiles.check(k, n)
        fwd = jax.jit(lambda x, w, gs, tiles=tiles: gpu.gmm(x, w, gs, config=tiles))
        err = rel_err(fwd(x, w, gs), ref)
        ms = bench(fwd, x, w, gs, n=10, inner=5)
      except Exception as exc:  # noqa: BLE001
        emit(gmm=shape, variant=name, tiles=str(tiles), error=repr(exc)[:300])
        continue
      ratio = jla_ms[shape] / ms if shape in jla_ms else None
      emit(gmm=shape, variant=name, tiles=str(tiles), ms=round(ms, 3),
           tflops=round(2 * m * k * n / ms / 1e9, 1), rel_err=err,
           jla_over_ours=ratio and round(ratio, 3))
      if err < 1e-2:
        results.setdefault(shape, []).append((ms, name, ratio))
  print("\nwinner per shape (forward, phase 3; jla / ours > 1: ours faster; rel_err < 1e-2 only):",
        flush=True)
  for shape, rows in results.items():
    ms, name, ratio = min(rows)
    heur = [r[0] for r in rows if r[1] == "heuristic"]
    print(f"  {shape}: {name} {ms:.3f} ms, jla / ours {ratio and round(ratio, 3)}; heuristic "
          f"{heur and round(heur[0], 3)} ms", flush=True)
  print(f"sweep took {time.perf_counter() - t0:.0f} s", flush=True)


def variant_check(name, vary, m=3008, k=512, n=512, sizes=(0, 900, 3, 0, 1200, 64, 1, 700)) -> bool:
  """Whether variant ``vary`` of :data:`VARIANTS` is right at a skewed problem (empty groups, rows
  past the sum, groups smaller than a tile), forward and, where the read of rhs differs, transposed
  (the d_lhs form), against the float32 XLA reference (relative error < 1e-2, tail rows zero)."""
  k0, k1 = jax.random.split(jax.random.key(9))
  gs = jnp.array(sizes, jnp.int32)
  total = int(gs.sum())  # < m
  x = jax.random.normal(k0, (m, k), jnp.bfloat16)
  w = jax.random.normal(k1, (gs.shape[0], k, n), jnp.bfloat16) / 16
  tiles = vary(gpu.default_tiles(m, gs.shape[0], k, n))
  default = tiles == gpu.default_tiles(m, gs.shape[0], k, n)  # also the d_lhs tiling
  transposed = (False, True) if default or tiles.consumers > 1 else (False,)
  ok = True
  for transpose_rhs in transposed:
    rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    ref = moe.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs, implementation="xla")
    try:
      out = gpu.gmm(x, rhs, gs, config=tiles, transpose_rhs=transpose_rhs)
      err, tail = rel_err(out, ref), bool(jnp.all(out[total:] == 0))
    except Exception as exc:  # noqa: BLE001
      emit(check=f"variant {name}", tiles=str(tiles), transposed=transpose_rhs, error=repr(exc)[:300])
      return False
    emit(check=f"variant {name}", tiles=str(tiles), transposed=transpose_rhs, rel_err=err,
         rows_past_sum_zero=tail)
    ok = ok and err < 1e-2 and tail
  return ok




def jla_ragged_dot():
  """jla's Mosaic GPU ragged_dot, or None (printed) when it does not import."""
  try:
    from jla.ops.mosaic_gpu.ragged_dot import ragged_dot
  except Exception as err:  # noqa: BLE001 - report and time the rest
    print("jla import failed:", repr(err)[:300], flush=True)
    return None
  return ragged_dot


def moe_layer(x, router, w_in, w_out, w_gate_up, w_down, norm, *, top, impl):
  """K3 routed MoE: sigmoid router (float32) -> top-k, renormalised weights; latent down projection;
  experts; RMSNorm; latent up projection. x [T, d] -> [T, d]."""
  scores = jax.nn.sigmoid(jnp.dot(x, router, preferred_element_type=jnp.float32))
  top_scores, ids = jax.lax.top_k(scores, top)
  weights = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
  y = moe.expert_mlp(x @ w_in, ids, weights, w_gate_up, w_down, SITU, implementation=impl)
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
    emit(check="layer pallas vs xla loss", rel_err=rel_err(va, vb))
    emit(check="layer pallas vs xla grads (max over args)", rel_err=max(rel_err(a, b) for a, b in zip(ga, gb)))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="no tgmm timing")
  parser.add_argument("--skip", default="", help="comma list of: checks, gmm, layer")
  parser.add_argument("--no-xla", action="store_true", help="do not time jax.lax.ragged_dot")
  parser.add_argument("--sweep", action="store_true", help="grouped-matmul checks and tiling sweep only")
  parser.add_argument("--budget", type=float, default=100.0,
                      help="seconds after which the sweep starts no new work")
  parser.add_argument("--shapes", default=None,
                      help="the sweep's shapes, E x M x K x N, comma-separated, M a multiple of E "
                           "(equal groups; default: PERF.md's; k3_1b's experts: "
                           "48x524160x512x1024,48x524160x512x512)")
  parser.add_argument("--no-bwd", action="store_true", help="the sweep times no forward+backward")
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  if args.sweep:
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for e, m, *_ in shapes:
      if m % e:
        parser.error(f"--shapes: M={m} is not a multiple of E={e} (the sweep's groups are equal)")
    sweep(args.budget, shapes, not args.no_bwd)
    return
  skip = set(args.skip.split(","))
  if "checks" not in skip:
    try:
      gmm_checks()
      mlp_checks()
    except Exception as err:  # noqa: BLE001 - still time the rest
      emit(check="failed", error=repr(err)[:500])
  if "gmm" not in skip:
    gmm_table(args.quick, args.no_xla)
  if "layer" not in skip:
    layer_table(args.no_xla)


if __name__ == "__main__":
  main()
