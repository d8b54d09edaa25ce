"""Card diagnostic of the Mosaic GPU ``kda_chunk_a`` (``a_mgpu``, off by default: wrong on the
card, right in GPU interpret mode; RESULTS.md, KDA run 14): its outputs against Triton's
``kda_chunk_a`` on small cases, and for a given log decay (gate=None, no L2 norm) the cumulative
sum G the kernel used, recovered from QG = scale q e^G, and G_C from gC = e^{G_C}.

  python3 benchmarks/kda_a_diag.py [N_VARIANTS [N_CASES]]

First a one-CTA probe of that product alone; then the first N_VARIANTS variants, ``a_mgpu`` with
parts of its source replaced (``VARIANTS``), all on each of the first N_CASES cases in turn
(Triton's outputs computed once a case; about 35 s a case on an H100, most of it compiling), so
that one device call tries candidate fixes beside the kernel as it is. On the CPU both kernels
run in interpret mode (the variants' code checked, not the card's behaviour).
"""

from __future__ import annotations

import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.kda import a_mgpu, chunk_dense, config  # noqa: E402

C = a_mgpu.CHUNK
NAMES = ("pkk", "aqk", "qg", "kd", "kg", "gc", "rq", "rk")
# (dtype, gate, L2 norm, T, H, HV, K)
CASES = [(jnp.float32, None, False, 64, 1, 1, 64), (jnp.float32, None, False, 1, 1, 1, 64),
         (jnp.float32, None, False, 64, 2, 2, 64), (jnp.bfloat16, None, False, 64, 1, 1, 64), (jnp.float32, "bounded", True, 64, 1, 1, 64),
         (jnp.float32, None, False, 128, 1, 1, 128), (jnp.bfloat16, "bounded", True, 600, 4, 4, 128)]


def variant(*changes: tuple[str, str]) -> types.ModuleType:
  """``a_mgpu`` with each ``(old, new)`` of ``changes`` (source text) replaced."""
  src = open(a_mgpu.__file__).read()
  for old, new in changes:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
  mod = types.ModuleType("a_mgpu_variant")
  mod.__file__ = a_mgpu.__file__
  exec(compile(src, a_mgpu.__file__, "exec"), mod.__dict__)
  return mod


# KDA runs 13-14: the kernel's G is right in the first rows and wrong in the last (at T = 1 its
# row 63 lacks x_0). In the Mosaic IR (lowered for CUDA on the CPU, before and after layout
# inference) that product is op for op dqkg_mgpu's, which is right on the card: the ones from the
# same iota, compare and convert in the WGMMA layout, the same register operand, the same swizzled
# bf16 parts. Forming the ones at the product (run 14's proposal) gives the same ops after CSE,
# only after the TMA wait (as the last variant has them). Interpret mode stages a register
# operand in SMEM, so the first candidates take the left operands from SMEM. Run 13's one case
# with a right QG (float32 given g, T83, HV2) masks x (T % 64 > 0) and runs 4 CTAs: the fourth
# variant and the third case test each.
G_PRODUCT = """    G = scoped(lambda *bufs, x=x: exact_products([(tril, x)], *own, *bufs, interpret=interpret),
               *[tile(bf16)] * (3 - len(own)))
"""
ONES_IN_SMEM = (G_PRODUCT, """    def ones_in_smem(ones, *bufs, x=x):
      from pallas_kernels.kda.chunk_mgpu import store_split
      ones[...] = tril
      store_split(x, own + bufs)
      plgpu.commit_smem()
      return wgmma.product((c, bk), *[(ones, b) for b in own + bufs], interpret=interpret)
    G = scoped(ones_in_smem, tile(bf16), *[tile(bf16)] * (3 - len(own)))
""")
ROW_FACTORS_IN_SMEM = ("  regs = dt.itemsize == 2", "  regs = False")
VARIANTS = [
    ("as is", lambda: a_mgpu),
    ("G's ones from SMEM", lambda: variant(ONES_IN_SMEM)),
    ("no register operands (G's ones and bf16 row factors from SMEM)",
     lambda: variant(ONES_IN_SMEM, ROW_FACTORS_IN_SMEM)),
    ("x masked on every row count", lambda: variant(("    if t % c:", "    if True:"))),
    ("TMA wait before the marks and the ones", lambda: variant(
        ("  seg_r, cont, last =", "  plgpu.barrier_wait(landed)\n  seg_r, cont, last ="),
        ("  tril = (rid >= cid).astype(bf16)\n  plgpu.barrier_wait(landed)\n",
         "  tril = (rid >= cid).astype(bf16)\n"))),
]


def _inputs(dtype, gate, t, h, hv, kd, seed=0):
  """(q, k, g, A_log, dt_bias, seg) of one case: T valid tokens padded to whole chunks."""
  rng = np.random.default_rng(seed)
  tp = -(-t // C) * C
  q, k = rng.standard_normal((2, 1, tp, h, kd))
  g = rng.standard_normal((1, tp, hv, kd))
  if gate is None:
    g = -np.exp(g - 3.0)
  for x in (q, k, g):
    x[:, t:] = 0
  cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)
  return (cast(q), cast(k), cast(g), jnp.asarray(0.5 * rng.standard_normal(hv), jnp.float32),
          jnp.asarray(0.5 * rng.standard_normal((hv, kd)) - 4.0, jnp.float32),
          jnp.zeros((1, tp), jnp.int32))


_TRITON = {}  # Triton's outputs by case, computed once for every variant


def _outputs(impl, dtype, gate, fused, t, h, hv, kd):
  """``chunk_dense.chunk_a``'s first 8 outputs (float32 NumPy) with ``chunk_a=impl``."""
  q, k, g, a_log, dtb, seg = _inputs(dtype, gate, t, h, hv, kd)
  tuning = config.KdaGpuConfig(chunk_a=impl)
  rows, sub = config.chunk_path(gate, -5.0, C, tuning)
  cfg = config.KdaOptions(scale=kd ** -0.5, chunk=C, use_qk_l2norm=fused, gate=gate,
                          lower_bound=-5.0, beta_is_logit=False, diag_rows=rows, sub_chunks=sub,
                          dtype=jnp.dtype(dtype).name, tuning=tuning)
  tp = q.shape[1]
  o = chunk_dense.chunk_a(cfg, q, k, jnp.zeros((1, tp, hv, 16), dtype), g,
                          jnp.zeros((1, tp, hv)), a_log, dtb, seg, t)
  return [np.asarray(jnp.asarray(x, jnp.float32)) for x in o[:8]]


def _ranges(rows) -> str:
  """Sorted row numbers as ranges: '4-15,48-63'."""
  out, rows = [], list(rows)
  while rows:
    j = 0
    while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
      j += 1
    out.append(f"{rows[0]}" if j == 0 else f"{rows[0]}-{rows[j]}")
    rows = rows[j + 1:]
  return ",".join(out) or "none"


def case(dtype, gate, fused, t, h, hv, kd):
  key = (dtype, gate, fused, t, h, hv, kd)
  if key not in _TRITON:
    _TRITON[key] = _outputs("triton", *key)
  want_all, got_all = _TRITON[key], _outputs("mosaic", *key)
  errs = {n: (float(np.nanmax(np.abs(a - b)) / (np.abs(b).max() + 1e-30)), int(np.isnan(a).sum()))
          for n, a, b in zip(NAMES, got_all, want_all)}
  print(f"{jnp.dtype(dtype).name} gate={gate} l2={fused} T{t} H{h} HV{hv} K{kd}", errs, flush=True)
  if gate is not None or fused:
    return
  # the G and G_C the kernel used (chunk 0; the first and the last value head: CTAs apart)
  q, _, g = (np.asarray(jnp.asarray(x, jnp.float32)) for x in _inputs(dtype, gate, t, h, hv,
                                                                        kd)[:3])
  n = min(t, C)
  for j in sorted({0, hv - 1}):
    want = np.cumsum(g[0, :n, j], axis=0)
    got = np.log(np.abs(got_all[2][0, :n, j] / (kd ** -0.5 * q[0, :n, j * h // hv])))
    err = np.abs(got - want).max(axis=1)
    rows = [0, 3, 4, 7, 8, 15, 16, 31, 32, 50, 63]
    tol = 1e-3 if dtype == jnp.float32 else 2e-2  # (bf16: QG's rounding)
    print(f"  head {j} G: rows wrong {_ranges(np.flatnonzero(err > tol).tolist())}; channel 0 "
          "got-want at rows " + ", ".join(f"{r}: {got[r, 0] - want[r, 0]:+.4f}" for r in rows
                                           if r < n)
          + f"; G_C got {np.round(np.log(got_all[5][0, 0, j, :4]), 4)} want "
          f"{np.round(np.log(want_all[5][0, 0, j, :4]), 4)}", flush=True)


def probe(three_d: bool, lower_only: bool = False):
  """G = tril @ x alone in a one-CTA kernel, formed as a_mgpu forms it (x by TMA into a swizzled
  float32 tile, a slice of a 3-D one with ``three_d``; the ones in registers, built before the
  TMA wait; ``chunk_mgpu.exact_products``): its wrong rows say whether the product is wrong by
  itself on the card or only inside a_mgpu. ``lower_only``: lowered for CUDA, not run."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels import wgmma
  from pallas_kernels.kda import chunk_mgpu as cm
  f32, bf16, interp = jnp.float32, jnp.bfloat16, config.interpret() and not lower_only

  def kern(x_ref, g_ref, x_smem, g_smem, landed):
    tile = x_smem.at[0] if three_d else x_smem
    plgpu.copy_gmem_to_smem(x_ref, tile, landed)
    rid, cid = cm.iota()
    tril = (rid >= cid).astype(bf16)
    plgpu.barrier_wait(landed)
    x = plgpu.load(tile, layout=plgpu.Layout.WGMMA)
    g_smem[...] = cm.scoped(lambda *bufs: cm.exact_products([(tril, x)], *bufs, interpret=interp),
                            *[cm.tile(bf16)] * 3)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_smem, g_ref)
    plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(
      kern, out_type=jax.ShapeDtypeStruct((C, C), f32),
      scratch_types=(wgmma.swizzled((1, C, C) if three_d else (C, C), f32),
                     plgpu.SMEM((C, C), f32), plgpu.Barrier(num_arrivals=1)),
      grid=(1,), grid_names=("i",), **wgmma.kernel_params(interp))
  if lower_only:
    return jax.jit(call).trace(jax.ShapeDtypeStruct((C, C), f32)).lower(
        lowering_platforms=("cuda",))
  x = -np.exp(np.random.default_rng(1).standard_normal((C, C)) - 3.0).astype(np.float32)
  got = np.asarray(call(jnp.asarray(x)))
  err = np.abs(got - np.cumsum(x.astype(np.float64), axis=0)).max(axis=1)
  print(f"probe, x in a {'3-D' if three_d else '2-D'} tile: G rows wrong "
        f"{_ranges(np.flatnonzero(err > 1e-5).tolist())}; row 63 channel 0 got {got[-1, 0]:.4f} "
        f"want {np.cumsum(x, axis=0)[-1, 0]:.4f}", flush=True)


def main():
  n_var = int(sys.argv[1]) if len(sys.argv) > 1 else None
  n_case = int(sys.argv[2]) if len(sys.argv) > 2 else None
  for three_d in (True, False):
    try:
      probe(three_d)
    except Exception as e:  # noqa: BLE001 - the variants still run
      print("probe FAILED", repr(e)[:800], flush=True)
  variants = [(name, make()) for name, make in VARIANTS[:n_var]]
  for args in CASES[:n_case]:  # every variant on a case before the next (a cut run says most)
    for name, mod in variants:
      print("=== a_mgpu:", name, flush=True)
      chunk_dense.a_mgpu = mod
      with jax.default_matmul_precision("highest"):
        try:
          case(*args)
        except Exception as e:  # noqa: BLE001 - the next case still says something
          print(args, "FAILED", repr(e)[:800], flush=True)


if __name__ == "__main__":
  main()
