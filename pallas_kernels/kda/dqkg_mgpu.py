"""``kda_chunk_dqkg`` of the dense path as a Mosaic GPU kernel (Hopper: TMA, wgmma).

Same results as ``chunk_dense._dense_dqkg_kernel`` (Triton) on the middle-row reference blocks
of ``diag_rows`` rows: per chunk of C = 64 tokens and K slice of 64 channels, the gradients
wrt the pre-processed q, k and the gate's log decay g, from the state entering the chunk (h),
the gradient of the state leaving it (dh), V', dO, dY and dP_kk. For a gate without a bound
(``sub_chunks``) the exponents are clamped to ``MAX_EXP`` as ``a_mgpu``'s are; the chunks that
``kda_chunk_a`` flagged are then redone by Triton's ``kda_chunk_dqkg_sub`` in place.

One warpgroup per (K slice, chunk, batch * value head), every input tile by TMA up front, each
phase's SMEM scoped so the next phase's takes its place (105 KB a CTA at K = V = 128, bf16: two
CTAs an SM; 209 KB for float32):
  - dO S^T, dP_qk = scale dO V'^T and V' dS^T in one group of wgmmas (SMEM operands), first:
    the later phases take their tiles' place;
  - G = tril @ g (three bf16 parts: the sum in float32), its reference rows through SMEM;
  - each pair product's gradient (P_qk, then P_kk) block by block: d a = e^{G - r} sum_I
    (dP masked to block I's rows) (k e^{r_I - G}), d k = sum_I e^{r_I - G} dP^T (a e^{G - r}
    masked to block I's rows), dP's parts from registers, dP^T from SMEM (a transposed
    operand); the operands on bf16 parts per ``KdaGpuConfig.gate_dot`` (three bf16 passes:
    hi hi + hi lo + lo hi; one bf16 pass; float32 inputs: three parts each, six products,
    about float32);
  - dg = (the reverse cumulative sum of dG) + sum_rows(k dKD) + cont_last e^{G_C} sum_V(h dh):
    the sums as products of the 0/1 matrices with three bf16 parts.
Shapes: q, k ``[B, Tp, H, K]``, g ``[B, Tp, HV, K]``, h, dh ``[B, NC, HV, K, V]``, V', dO
``[B, Tp, HV, V]`` (all of the kernels' dtype), dY ``[B, Tp, HV, K]``, dP_kk ``[B, Tp, HV, C]``;
results as ``chunk_dense.chunk_dqkg``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kernel_output, wgmma
from pallas_kernels.kda.chunk_mgpu import (SLICE, bcast, exact_products, gate, iota, marks,
                                           scoped, split, store_split, tile, vec)
from pallas_kernels.kda.config import BF16, MAX_EXP, KdaOptions
from pallas_kernels.kda.recurrence_mgpu import CHUNK


def _parts(dt, dot) -> int:
  """bf16 parts per operand of a pair-product gradient at the algorithm ``dot``: float32 inputs
  three (about float32), else one for a single bf16 pass and two (three bf16 passes) for
  the rest."""
  return 3 if dt.itemsize == 4 else 1 if dot == BF16 else 2


def _cross(a, b):
  """The part products kept of operands split into parts ``a`` and ``b``: those whose parts'
  ranks sum below the larger count (hi hi, hi lo, lo hi for two)."""
  n = max(len(a), len(b))
  return [(x, y) for i, x in enumerate(a) for j, y in enumerate(b) if i + j < n]


def _tiles(q, vn, hs, dy, dpkk):
  """The SMEM input tiles of one CTA: (q, k, g, dY, dP_kk) for the whole kernel and (dO, V', h,
  dh) for its first phase (the products with the states; later phases take their place)."""
  c, vd = CHUNK, vn.shape[-1]
  sw = wgmma.swizzled
  return ((sw((c, SLICE), q.dtype),) * 3 + (sw((c, SLICE), dy.dtype), sw((c, c), dpkk.dtype)),
          (sw((c, vd), vn.dtype),) * 2 + (sw((SLICE, vd), hs.dtype),) * 2)


def supported(cfg: KdaOptions, q, k, g, hs, dh, vn, do) -> bool:
  """Whether the kernel takes these operands: 64-token chunks on the middle-row blocks, K = 64
  or 128, V = 64 or 128, q, k, g, h, dh, V' and dO of the kernels' dtype (bf16 or float32)."""
  dt = jnp.dtype(cfg.dtype)
  return (cfg.chunk == CHUNK and cfg.diag_rows > 0 and q.shape[-1] in (64, 128)
          and vn.shape[-1] in (64, 128) and all(x.dtype == dt for x in (q, k, g, hs, dh, vn, do)))


def _kernel(q_ref, k_ref, g_ref, alog_ref, dtb_ref, marks_ref, rows_ref, h_ref, dh_ref, vn_ref,
            do_ref, dy_ref, dpkk_ref, dq_ref, dk_ref, dg_ref, q_smem, k_smem, g_smem, dy_smem,
            dpkk_smem, vec_smem, landed, *, cfg, hv, group, t, state_tiles, interpret):
  c, f32, bf16, bk = CHUNK, jnp.float32, jnp.bfloat16, SLICE
  dt = jnp.dtype(cfg.dtype)
  wg = plgpu.Layout.WGMMA
  s, ci, bh = lax.axis_index("s"), lax.axis_index("c"), lax.axis_index("bh")
  b, h = lax.div(bh, jnp.int32(hv)), lax.rem(bh, jnp.int32(hv))  # equal dtypes under x64 too
  hq = lax.div(h, jnp.int32(group))
  rows, cols = pl.ds(ci * c, c), pl.ds(s * bk, bk)
  ld = lambda ref: plgpu.load(ref, layout=wg).astype(f32)

  def states(do_smem, vn_smem, h_smem, dh_smem):
    """Every tile by TMA; dO S^T, dP_qk = dO V'^T, V' dS^T [C, BK | C] (one group of wgmmas) and
    sum_V h dh per channel to ``vec_smem``."""
    for src, dst in ((q_ref.at[b, rows, hq, cols], q_smem),
                     (k_ref.at[b, rows, hq, cols], k_smem), (g_ref.at[b, rows, h, cols], g_smem),
                     (dy_ref.at[b, rows, h, cols], dy_smem), (dpkk_ref.at[b, rows, h], dpkk_smem),
                     (do_ref.at[b, rows, h], do_smem), (vn_ref.at[b, rows, h], vn_smem),
                     (h_ref.at[b, ci, h, cols], h_smem), (dh_ref.at[b, ci, h, cols], dh_smem)):
      plgpu.copy_gmem_to_smem(src, dst, landed)
    plgpu.barrier_wait(landed)
    vec_smem[...] = jnp.sum(ld(h_smem) * ld(dh_smem), axis=1)
    return wgmma.products(((c, bk), [(do_smem, h_smem.T)]), ((c, c), [(do_smem, vn_smem.T)]),
                          ((c, bk), [(vn_smem, dh_smem.T)]), interpret=interpret)

  dq, dpqk, dkd = pl.run_scoped(states, *state_tiles)
  seg_r, cont, last = (bcast(vec(marks_ref.at[b, j, rows], wgmma.ROWS), 0) for j in range(3))
  same = seg_r == bcast(vec(marks_ref.at[b, 3, rows], wgmma.COLS), 1)
  beta, rq, rk = (bcast(vec(rows_ref.at[b, h, j, rows], wgmma.ROWS), 0) for j in range(3))
  cont_last = marks_ref[b, 1, ci * c + c - 1]
  rid, cid = iota()
  incl = same & (rid >= cid)
  q, k, x = ld(q_smem) * rq, ld(k_smem) * rk, ld(g_smem)
  if cfg.gate is not None:
    x = gate(cfg, x, jnp.exp(alog_ref[h]), bcast(vec(dtb_ref.at[h, cols], wgmma.COLS), 1))
  if t % c:  # padded tokens leave the state alone
    x = jnp.where(ci * c + rid < t, x, 0.0)
  G = scoped(lambda *bufs: exact_products([((rid >= cid).astype(bf16), x)], *bufs,
                                          interpret=interpret), *[tile(bf16)] * 4)

  n = cfg.diag_rows
  nb = c // n

  def references(g32):
    """The blocks' reference rows (at their middle rows) and G_C ([BK] each) through SMEM."""
    g32[...] = G
    plgpu.commit_smem()
    return [bcast(vec(g32.at[i], wgmma.COLS), 1) for i in
            [i * n + n // 2 - 1 for i in range(nb)] + [c - 1]]

  *refs, gl = scoped(references, plgpu.SMEM((c, bk), f32))
  ref_rows = refs[0]
  for i in range(1, nb):
    ref_rows = jnp.where(rid >= i * n, refs[i], ref_rows)
  # a gate without a bound: exponents clamped (where the clamp bites, the chunk is redone)
  exp = (lambda y: jnp.exp(jnp.minimum(y, MAX_EXP))) if cfg.sub_chunks else jnp.exp
  e_row = exp(G - ref_rows)
  eg = jnp.exp(G)

  dq = cfg.scale * cont * eg * dq
  dpqk = jnp.where(incl, cfg.scale * dpqk, 0.0)
  dkd = last * jnp.exp(gl - G) * dkd

  def pairs(a_side, dp, dots, *bufs):
    """Gradients (d a, d k) [C, BK] of the pair product P_ij = sum_d a_id k_jd e^{G_id - G_jd}
    (i >= j) given dP ``dp`` [C, C] float32, operands on parts per the algorithms ``dots`` (for
    d a, for d k); ``bufs``: dP's parts (for d k), then the column factors' and the masked row
    factors' (each block's in turn)."""
    na, nk = _parts(dt, dots[0]), _parts(dt, dots[1])
    p_bufs, kc_bufs, la_bufs = bufs[:nk], bufs[nk:nk + na], bufs[nk + na:]
    p_parts = split(dp, max(na, nk))
    for buf, part in zip(p_bufs, p_parts):
      buf[...] = part
    la = a_side * e_row
    da = db = None
    for i in range(nb):
      if i:
        plgpu.commit_smem()  # the last block's products are done with the buffers
      rws = (rid >= i * n) & (rid < (i + 1) * n)
      col = jnp.where(rid < (i + 1) * n, exp(refs[i] - G), 0.0)
      store_split(k * col, kc_bufs)
      store_split(jnp.where(rws, la, 0.0), la_bufs)
      plgpu.commit_smem()
      rows_p = [wgmma.Regs(jnp.where(rws, part, jnp.zeros((), bf16))) for part in p_parts[:na]]
      x, y = wgmma.products(((c, bk), _cross(rows_p, kc_bufs)),
                            ((c, bk), _cross([buf.T for buf in p_bufs], la_bufs)),
                            interpret=interpret)
      da = x if da is None else da + x
      db = col * y if db is None else db + col * y
    return da * e_row, db

  def pair_bufs(dots):
    na, nk = _parts(dt, dots[0]), _parts(dt, dots[1])
    return [wgmma.swizzled((c, c), bf16)] * nk + [tile(bf16)] * (na + nk)

  qdots, kdots = cfg.tuning.gate_dot
  daq, dk = scoped(functools.partial(pairs, q, dpqk, qdots), *pair_bufs(qdots))
  dq = dq + daq
  dG = q * dq - k * dk
  dak, dbk = scoped(functools.partial(pairs, k, ld(dpkk_smem), kdots), *pair_bufs(kdots))
  dky = beta * eg * ld(dy_smem)
  dk = dk + dak + dbk + dky + dkd
  dG = dG + k * (dak - dbk + dky - dkd)

  # dg_i = sum_{t >= i} dG_t + sum_rows k dKD + cont_last e^{G_C} sum_V h dh (the last through
  # SMEM, from a value per row of the states to one per column)
  sums = scoped(lambda *bufs: exact_products(
      [((rid <= cid).astype(bf16), dG), ((rid >= 0).astype(bf16), k * dkd)], *bufs,
      interpret=interpret), *[tile(bf16)] * 8)
  dg = sums + cont_last * jnp.exp(gl) * bcast(vec(vec_smem, wgmma.COLS), 1)

  def store(dq_smem, dk_smem, dg_smem):
    for buf, val in ((dq_smem, dq), (dk_smem, dk), (dg_smem, dg)):
      buf[...] = val.astype(buf.dtype)
    plgpu.commit_smem()
    for buf, out in ((dq_smem, dq_ref), (dk_smem, dk_ref), (dg_smem, dg_ref)):
      plgpu.copy_smem_to_gmem(buf, out.at[b, rows, h, cols])
    plgpu.wait_smem_to_gmem(0)

  scoped(store, tile(dq_ref.dtype), tile(dk_ref.dtype), tile(dg_ref.dtype))


def chunk_dqkg(cfg: KdaOptions, q, k, g, beta, A_log, dt_bias, seg, cont, hs, dh, vn, do, dy,
               dpkk, rq, rk, t, *, hv: int, out_dtypes, interpret: bool):
  """(dq, dk, dg) ``[B, Tp, HV, K]`` of ``out_dtypes``, as ``chunk_dense._dense_dqkg_kernel``
  writes them; beta ``[B, Tp, HV]`` float32 (the gate's value, zero on padded tokens), rq, rk
  ``[B, Tp, HV]`` the rows' inverse norms, cont ``[B, Tp]`` float32 (1 where a token continues
  the state entering its chunk)."""
  bsz, tp, h, kd = q.shape
  f32 = jnp.float32
  per_row = jnp.transpose(jnp.stack([beta, rq, rk], axis=-1).astype(f32), (0, 2, 3, 1))
  tiles, state_tiles = _tiles(q, vn, hs, dy, dpkk)
  kern = functools.partial(_kernel, cfg=cfg, hv=hv, group=hv // h, t=t, state_tiles=state_tiles,
                           interpret=interpret)
  kern.__name__ = "kda_chunk_dqkg_mgpu"
  scratch = tiles + (plgpu.SMEM((SLICE,), f32), plgpu.Barrier(num_arrivals=9))
  out_type = tuple(jax.ShapeDtypeStruct((bsz, tp, hv, kd), d) for d in out_dtypes)
  outs = plgpu.kernel(
      kern, out_type=out_type, scratch_types=scratch, grid=(kd // SLICE, tp // CHUNK, bsz * hv),
      grid_names=("s", "c", "bh"), **wgmma.kernel_params(interpret))(
          q, k, g, A_log.astype(f32), dt_bias.astype(f32), marks(seg, cont), per_row, hs, dh,
          vn, do, dy, dpkk)
  return tuple(kernel_output(x) for x in outs)
