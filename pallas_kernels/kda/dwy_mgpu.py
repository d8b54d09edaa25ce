"""``kda_chunk_dwy`` of the dense path as a Mosaic GPU kernel (Hopper: TMA, wgmma).

Same results as ``chunk_dense._dense_dwy_kernel`` (Triton), the WY part of the backward per
chunk of C = 64 tokens: with W = X Y, U = X Z (Y = diag(beta) KG, Z = diag(beta) v, X the
inverse of ``kda_chunk_wu``), dW = -cont dV' S^T and dU = dV':
  dZ = X^T dV' (dv = beta dZ), dY = X^T dW, dX = dV' Z^T + dW Y^T,
  dA_kk = -X^T dX X^T (strictly lower same-segment pairs; dpkk = beta dA_kk) and
  dbeta = rowsum(dZ v) + rowsum(dY KG) + rowsum(dA_kk P_kk).
One warpgroup per (chunk, batch * value head), every input by TMA up front (195 KB of SMEM at
K = V = 128 with the largest phase's). The float32
operands (X, Z, Y, dW, dX, X^T dX) go in as two bf16 parts (``x ~ hi + lo``: hi hi + hi lo +
lo hi, about 16 bits, against TF32's 11 in the Triton kernel), X's parts in SMEM for the whole
kernel (X^T and X^T as the right operand are its transposed views); dV', v, KG and S are bf16
already (one part).
Shapes: v, dV' ``[B, Tp, HV, V]``, KG ``[B, Tp, HV, K]``, S ``[B, NC, HV, K, V]`` (bf16), X,
P_kk ``[B, Tp, HV, C]`` float32, beta ``[B, HV, Tp]`` float32 (the gate's value, zero on padded
tokens), marks ``[B, 4, Tp]`` (``chunk_mgpu.marks``); results as ``chunk_dense.chunk_dwy``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kernel_output, wgmma
from pallas_kernels.kda.chunk_mgpu import bcast, iota, marks, scoped, split, store_split, vec
from pallas_kernels.kda.config import KdaOptions
from pallas_kernels.kda.recurrence_mgpu import CHUNK


def supported(cfg: KdaOptions, v, kg, hs, dvn, x) -> bool:
  """Whether the kernel takes these operands: 64-token chunks, K and V of 64 or 128, v, KG, the
  states and dV' bf16, X float32."""
  bf16 = jnp.dtype(jnp.bfloat16)
  return (cfg.chunk == CHUNK and kg.shape[-1] in (64, 128) and v.shape[-1] in (64, 128)
          and all(a.dtype == bf16 for a in (v, kg, hs, dvn)) and x.dtype == jnp.float32)


def _kernel(v_ref, kg_ref, hs_ref, dvn_ref, x_ref, pkk_ref, beta_ref, marks_ref, dpkk_ref, dy_ref,
            dv_ref, dbeta_ref, v_smem, kg_smem, s_smem, dvn_smem, x_smem, pkk_smem, xp_smem,
            dbeta_smem, landed, *, hv, interpret):
  c, f32, bf16 = CHUNK, jnp.float32, jnp.bfloat16
  kd, vd = kg_smem.shape[-1], v_smem.shape[-1]
  wg = plgpu.Layout.WGMMA
  ci, bh = lax.axis_index("c"), lax.axis_index("bh")
  b, h = lax.div(bh, jnp.int32(hv)), lax.rem(bh, jnp.int32(hv))  # equal dtypes under x64 too
  rows = pl.ds(ci * c, c)
  for src, dst in ((v_ref.at[b, rows, h], v_smem), (kg_ref.at[b, rows, h], kg_smem),
                   (hs_ref.at[b, ci, h], s_smem), (dvn_ref.at[b, rows, h], dvn_smem),
                   (x_ref.at[b, rows, h], x_smem), (pkk_ref.at[b, rows, h], pkk_smem)):
    plgpu.copy_gmem_to_smem(src, dst, landed)
  seg_r, cont = (vec(marks_ref.at[b, j, rows], wgmma.ROWS) for j in range(2))
  same = bcast(seg_r, 0) == bcast(vec(marks_ref.at[b, 3, rows], wgmma.COLS), 1)
  beta = vec(beta_ref.at[b, h, rows], wgmma.ROWS)
  rid, cid = iota()
  strict = same & (rid > cid)
  ld = lambda ref: plgpu.load(ref, layout=wg).astype(f32)
  rowwise = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # [C] -> [C, N]
  plgpu.barrier_wait(landed)

  xs = [xp_smem.at[j] for j in range(2)]
  store_split(ld(x_smem), xs)
  plgpu.commit_smem()
  xt = [buf.T for buf in xs]  # X^T as the left operand

  # dZ = X^T dV', dW = -cont dV' S^T
  dz, dw = wgmma.products(((c, vd), [(a, dvn_smem) for a in xt]),
                          ((c, kd), [(dvn_smem, s_smem.T)]), interpret=interpret)
  dw = -rowwise(cont, (c, kd)) * dw
  v = ld(v_smem)
  dbeta = jnp.sum(dz * v, axis=1)
  dv = rowwise(beta, (c, vd)) * dz

  def dx_of(*bufs):
    """dX = dV' Z^T + dW Y^T (``bufs``: Z's and Y's parts)."""
    z_bufs, y_bufs = bufs[:2], bufs[2:]
    store_split(rowwise(beta, (c, vd)) * v, z_bufs)
    store_split(rowwise(beta, (c, kd)) * ld(kg_smem), y_bufs)
    plgpu.commit_smem()
    dwp = [wgmma.Regs(p) for p in split(dw, 2)]
    return wgmma.product((c, c), *[(dvn_smem, z.T) for z in z_bufs],
                         (dwp[0], y_bufs[0].T), (dwp[0], y_bufs[1].T), (dwp[1], y_bufs[0].T),
                         interpret=interpret)

  def dy_of(*dw_bufs):
    """dY = X^T dW."""
    store_split(dw, dw_bufs)
    plgpu.commit_smem()
    return wgmma.product((c, kd), (xt[0], dw_bufs[0]), (xt[0], dw_bufs[1]), (xt[1], dw_bufs[0]),
                         interpret=interpret)

  dx = scoped(dx_of, *[wgmma.swizzled((c, vd), bf16)] * 2, *[wgmma.swizzled((c, kd), bf16)] * 2)
  dy = scoped(dy_of, *[wgmma.swizzled((c, kd), bf16)] * 2)
  dbeta = dbeta + jnp.sum(dy * ld(kg_smem), axis=1)

  def pair_grad(*dx_bufs):
    """dA_kk = -X^T dX X^T on the strictly lower same-segment pairs."""
    store_split(dx, dx_bufs)
    plgpu.commit_smem()
    t1 = wgmma.product((c, c), (xt[0], dx_bufs[0]), (xt[0], dx_bufs[1]), (xt[1], dx_bufs[0]),
                       interpret=interpret)
    tp = [wgmma.Regs(p) for p in split(t1, 2)]
    return wgmma.product((c, c), (tp[0], xs[0].T), (tp[0], xs[1].T), (tp[1], xs[0].T),
                         interpret=interpret)

  da = jnp.where(strict, -scoped(pair_grad, *[wgmma.swizzled((c, c), bf16)] * 2), 0.0)
  dbeta = dbeta + jnp.sum(da * ld(pkk_smem), axis=1)
  dpkk = bcast(beta, 0) * da

  def store(dpkk_smem, dy_smem, dv_smem):
    for buf, val in ((dpkk_smem, dpkk), (dy_smem, dy), (dv_smem, dv)):
      buf[...] = val.astype(buf.dtype)
    dbeta_smem[...] = dbeta
    plgpu.commit_smem()
    for buf, out in ((dpkk_smem, dpkk_ref), (dy_smem, dy_ref), (dv_smem, dv_ref)):
      plgpu.copy_smem_to_gmem(buf, out.at[b, rows, h])
    plgpu.copy_smem_to_gmem(dbeta_smem, dbeta_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  scoped(store, wgmma.swizzled((c, c), dpkk_ref.dtype), wgmma.swizzled((c, kd), dy_ref.dtype),
         wgmma.swizzled((c, vd), dv_ref.dtype))


def chunk_dwy(v, beta, seg, cont, x, pkk, kg, hs, dvn, *, out_dtypes, interpret: bool):
  """(dpkk ``[B, Tp, HV, C]``, dy ``[B, Tp, HV, K]``, dv ``[B, Tp, HV, V]`` of ``out_dtypes`` and
  dbeta ``[B, Tp, HV]`` float32), as ``chunk_dense._dense_dwy_kernel`` writes them; beta
  ``[B, Tp, HV]`` float32 (the gate's value, zero on padded tokens), cont ``[B, Tp]`` float32 (1
  where a token continues the state entering its chunk)."""
  bsz, tp, hv, vd = v.shape
  kd = kg.shape[-1]
  c, f32, bf16 = CHUNK, jnp.float32, jnp.bfloat16
  kern = functools.partial(_kernel, hv=hv, interpret=interpret)
  kern.__name__ = "kda_chunk_dwy_mgpu"
  sw = wgmma.swizzled
  scratch = (
      sw((c, vd), bf16), sw((c, kd), bf16), sw((kd, vd), bf16), sw((c, vd), bf16),  # v, KG, S, dV'
      sw((c, c), f32), sw((c, c), f32),  # X, P_kk
      sw((2, c, c), bf16),  # X's parts
      plgpu.SMEM((c,), f32),  # dbeta
      plgpu.Barrier(num_arrivals=6),
  )
  out_type = tuple(jax.ShapeDtypeStruct((bsz, tp, hv, d), dt)
                   for d, dt in zip((c, kd, vd), out_dtypes)) + (
      jax.ShapeDtypeStruct((bsz, hv, tp), f32),)
  outs = plgpu.kernel(
      kern, out_type=out_type, scratch_types=scratch, grid=(tp // c, bsz * hv),
      grid_names=("c", "bh"), **wgmma.kernel_params(interpret))(
          v, kg, hs, dvn, x, pkk, jnp.swapaxes(beta, 1, 2), marks(seg, cont))
  dpkk, dy, dv, dbeta = (kernel_output(o) for o in outs)
  return dpkk, dy, dv, jnp.swapaxes(dbeta, 1, 2)
