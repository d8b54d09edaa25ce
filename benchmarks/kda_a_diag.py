"""Card diagnostic of the Mosaic GPU ``kda_chunk_a`` (``a_mgpu``, off by default: wrong on the
card, right in GPU interpret mode; RESULTS.md, KDA run 14): its outputs against Triton's
``kda_chunk_a`` on small cases, and for a given log decay (gate=None, no L2 norm) the cumulative
sum G the kernel used, recovered from QG = scale q e^G, and G_C from gC = e^{G_C}.

  python3 benchmarks/kda_a_diag.py [N_VARIANTS [N_CASES]]

Variants are ``a_mgpu`` with one source line replaced (``VARIANTS``), each tried on the first
N_CASES cases (about 35 s a case on an H100, most of it compiling), so that one device call
tries a candidate fix beside the kernel as it is.
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
         (jnp.bfloat16, None, False, 64, 1, 1, 64), (jnp.float32, "bounded", True, 64, 1, 1, 64),
         (jnp.float32, None, False, 128, 1, 1, 128), (jnp.bfloat16, "bounded", True, 600, 4, 4, 128)]


def variant(old: str, new: str) -> types.ModuleType:
  """``a_mgpu`` with the source text ``old`` replaced by ``new``."""
  src = open(a_mgpu.__file__).read()
  assert old in src, old
  mod = types.ModuleType("a_mgpu_variant")
  mod.__file__ = a_mgpu.__file__
  exec(compile(src.replace(old, new), a_mgpu.__file__, "exec"), mod.__dict__)
  return mod


# KDA run 13: the kernel's G is right in the first rows and wrong in the last (at T = 1 its row 63
# lacks x_0): the product with the lower-triangular ones from registers. dqkg_mgpu, right on
# the card, forms those ones where it multiplies; a_mgpu forms them once before the loop.
VARIANTS = [("ones formed at the product", lambda: variant(
    "exact_products([(tril, x)]", "exact_products([((rid >= cid).astype(bf16), x)]")),
    ("as is", lambda: a_mgpu)]


def case(dtype, gate, fused, t, h, hv, kd, seed=0):
  rng = np.random.default_rng(seed)
  tp = -(-t // C) * C
  q, k = rng.standard_normal((2, 1, tp, h, kd))
  g = rng.standard_normal((1, tp, hv, kd))
  if gate is None:
    g = -np.exp(g - 3.0)
  for x in (q, k, g):
    x[:, t:] = 0
  seg = jnp.zeros((1, tp), jnp.int32)
  a_log = jnp.asarray(0.5 * rng.standard_normal(hv), jnp.float32)
  dtb = jnp.asarray(0.5 * rng.standard_normal((hv, kd)) - 4.0, jnp.float32)
  cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)
  outs = {}
  for impl in ("triton", "mosaic"):
    tuning = config.KdaGpuConfig(chunk_a=impl)
    rows, sub = config.chunk_path(gate, -5.0, C, tuning)
    cfg = config.KdaOptions(scale=kd ** -0.5, chunk=C, use_qk_l2norm=fused, gate=gate,
                            lower_bound=-5.0, beta_is_logit=False, diag_rows=rows, sub_chunks=sub,
                            dtype=jnp.dtype(dtype).name, tuning=tuning)
    o = chunk_dense.chunk_a(cfg, cast(q), cast(k), jnp.zeros((1, tp, hv, 16), dtype), cast(g),
                            jnp.zeros((1, tp, hv)), a_log, dtb, seg, t)
    outs[impl] = [np.asarray(jnp.asarray(x, jnp.float32)) for x in o[:8]]
  errs = {n: (float(np.nanmax(np.abs(a - b)) / (np.abs(b).max() + 1e-30)), int(np.isnan(a).sum()))
          for n, a, b in zip(NAMES, outs["mosaic"], outs["triton"])}
  print(f"{jnp.dtype(dtype).name} gate={gate} l2={fused} T{t} H{h} HV{hv} K{kd}", errs, flush=True)
  if gate is None and not fused:  # the G and G_C the kernel used (chunk 0, head 0)
    n = min(t, C)
    want = np.cumsum(np.asarray(cast(g), np.float32), axis=1)[0, :n, 0]
    qs = kd ** -0.5 * np.asarray(cast(q), np.float32)[0, :n, 0]
    got = np.log(np.abs(outs["mosaic"][2][0, :n, 0] / qs))
    bad = np.flatnonzero(np.abs(got - want).max(axis=1) > 1e-3)
    print(f"  G: rows wrong {bad.tolist()}; row {n - 1} got {np.round(got[-1, :4], 4)} want "
          f"{np.round(want[-1, :4], 4)}; G_C got {np.round(np.log(outs['mosaic'][5][0, 0, 0, :4]), 4)}"
          f" want {np.round(np.log(outs['triton'][5][0, 0, 0, :4]), 4)}", flush=True)


def main():
  n_var = int(sys.argv[1]) if len(sys.argv) > 1 else None
  n_case = int(sys.argv[2]) if len(sys.argv) > 2 else None
  for name, make in VARIANTS[:n_var]:
    print("=== a_mgpu:", name, flush=True)
    chunk_dense.a_mgpu = make()
    with jax.default_matmul_precision("highest"):
      for args in CASES[:n_case]:
        try:
          case(*args)
        except Exception as e:  # noqa: BLE001 - the next case still says something
          print(args, "FAILED", repr(e)[:800], flush=True)


if __name__ == "__main__":
  main()
