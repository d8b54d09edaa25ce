"""One-CTA probe of the wgmma product that ``kda_chunk_a`` (``a_mgpu``) went wrong on: G = tril @ x
for a [64, 64] float32 x (by TMA into a swizzled tile) on its three bf16 parts in SMEM, the
lower-triangular ones [64, 64] bf16 as the left operand either in registers (``wgmma.Regs``, in
the WGMMA layout) or in SMEM. KDA run 15 (one H200): from registers rows 8-15 of every 16 are wrong,
from SMEM all are right (what ``chunk_mgpu.exact_products`` now does). A repro to report upstream.

  python3 benchmarks/wgmma_regs_probe.py

On the CPU the kernel runs in GPU interpret mode, which stages a register operand in SMEM: both
forms agree there.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels import wgmma  # noqa: E402
from pallas_kernels.kda import chunk_mgpu as cm  # noqa: E402
from pallas_kernels.kda import config  # noqa: E402

C = cm.CHUNK


def probe(regs: bool) -> np.ndarray:
  """G [C, C] from the kernel with the ones in registers (``regs``) or in SMEM."""
  f32, bf16, interp = jnp.float32, jnp.bfloat16, config.interpret()

  def kern(x_ref, g_ref, x_smem, g_smem, ones_smem, parts, landed):
    plgpu.copy_gmem_to_smem(x_ref, x_smem, landed)
    rid, cid = cm.iota()
    tril = (rid >= cid).astype(bf16)
    plgpu.barrier_wait(landed)
    x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
    cm.store_split(x, parts)
    ones_smem[...] = tril
    plgpu.commit_smem()
    lhs = wgmma.Regs(tril) if regs else ones_smem
    g_smem[...] = wgmma.product((C, C), *[(lhs, p) for p in parts], interpret=interp)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_smem, g_ref)
    plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(
      kern, out_type=jax.ShapeDtypeStruct((C, C), f32),
      scratch_types=(wgmma.swizzled((C, C), f32), plgpu.SMEM((C, C), f32), cm.tile(bf16),
                     [cm.tile(bf16)] * 3, plgpu.Barrier(num_arrivals=1)),
      grid=(1,), grid_names=("i",), **wgmma.kernel_params(interp))
  x = -np.exp(np.random.default_rng(1).standard_normal((C, C)) - 3.0).astype(np.float32)
  return x, np.asarray(call(jnp.asarray(x)))


def wrong_rows(err) -> str:
  """Rows whose error exceeds 1e-5, as ranges ('8-15,24-31')."""
  rows, out = np.flatnonzero(err > 1e-5).tolist(), []
  while rows:
    j = 0
    while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
      j += 1
    out.append(f"{rows[0]}" if j == 0 else f"{rows[0]}-{rows[j]}")
    rows = rows[j + 1:]
  return ",".join(out) or "none"


def main():
  print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
  for regs in (True, False):
    x, got = probe(regs)
    want = np.cumsum(x.astype(np.float64), axis=0)
    err = np.abs(got - want).max(axis=1)
    print(f"ones from {'registers' if regs else 'SMEM'}: rows wrong {wrong_rows(err)}; "
          f"row 63 channel 0 got {got[-1, 0]:.4f} want {want[-1, 0]:.4f}", flush=True)


if __name__ == "__main__":
  main()
