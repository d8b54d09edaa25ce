"""``kda_chunk_a`` of the dense path as a Mosaic GPU kernel (Hopper: TMA, wgmma from registers).

Same results as ``chunk_dense._dense_a_kernel`` (Triton) on the middle-row reference blocks of
``diag_rows`` rows: per chunk of C = 64 tokens the gate (fused from the raw f or given), its
cumulative sum G, P_kk [C, C] (strict, same segment, float32, no beta), A_qk (``scale``,
inclusive), QG = scale cont q e^G, KD = last k e^{G_C - G}, KG = k e^G, gC = cont_last e^{G_C}
and the rows' inverse L2 norms of q and k. For a gate without a bound (``sub_chunks``) the
exponents are clamped to ``MAX_EXP`` and each row's largest ``|G - r|`` is returned, from which
:func:`chunk_a` flags the chunks that ``kda_chunk_a_sub`` (Triton) redoes on sub-chunks.

One warpgroup per (chunk, batch * value head), the K axis in 64-channel slices, each phase's
SMEM scoped so the next phase's takes its place (74 KB a CTA at K = 128, bf16: three CTAs an SM):
  - q, k and g of the chunk arrive by TMA; G is ``tril @ g`` on three bf16 parts of g (the sum in
    float32, as ``chunk_dense.dot_cumsum``), a wgmma whose left operand (the ones) is in SMEM
    (``chunk_mgpu.exact_products``), the first part in g's own tile;
  - G goes through SMEM (float32) for the reference rows r_I and G_C;
  - QG, KD, KG overwrite the slice's q, k, g tiles and go out by TMA;
  - per block I the column factor ``k e^{r_I - G}`` (zero from the block's end) goes to SMEM and
    both pair products take ``(k|q) e^{G - r}`` masked to the block's rows from registers
    (float32: through SMEM, TF32 takes no register operand), accumulating over the slices;
  - P_kk, A_qk, gC and the per-row values go out by TMA at the end.
Shapes: q, k ``[B, Tp, H, K]``, g ``[B, Tp, HV, K]`` (all of the kernels' dtype, bf16 or float32
whose products are TF32's), A_log ``[HV]``, dt_bias ``[HV, K]`` float32, seg ``[B, Tp]`` int32;
results as ``chunk_dense.chunk_a``'s (the kernel writes the per-row values as ``[B, HV, n, Tp]``,
TMA's contiguous rows, transposed after).
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
                                           scoped, tile, vec)
from pallas_kernels.kda.config import MAX_EXP, KdaOptions
from pallas_kernels.kda.recurrence_mgpu import CHUNK
from pallas_kernels.kda.reference import L2_EPS


def supported(cfg: KdaOptions, q, k, g) -> bool:
  """Whether the kernel takes these operands: 64-token chunks on the middle-row blocks, K = 64
  or 128, q, k and g of the kernels' dtype (bf16 or float32)."""
  dt = jnp.dtype(cfg.dtype)
  return (cfg.chunk == CHUNK and cfg.diag_rows > 0 and q.shape[-1] in (64, 128)
          and all(x.dtype == dt for x in (q, k, g)))


def _kernel(q_ref, k_ref, g_ref, alog_ref, dtb_ref, marks_ref, pkk_ref, a_ref, qg_ref, kd_ref,
            kg_ref, gc_ref, *rest, cfg, hv, group, t, interpret):
  n_rows = 2 * cfg.use_qk_l2norm + cfg.sub_chunks
  rows_ref, (q_smem, k_smem, g_smem, gc_smem, rows_smem, landed) = (
      (rest[0], rest[1:]) if n_rows else (None, rest))
  c, f32, bf16, bk = CHUNK, jnp.float32, jnp.bfloat16, SLICE
  dt = jnp.dtype(cfg.dtype)
  ns = q_ref.shape[-1] // bk
  wg = plgpu.Layout.WGMMA
  ci, bh = lax.axis_index("c"), lax.axis_index("bh")
  b, h = lax.div(bh, jnp.int32(hv)), lax.rem(bh, jnp.int32(hv))  # equal dtypes under x64 too
  hq = lax.div(h, jnp.int32(group))
  rows = pl.ds(ci * c, c)
  cols = lambda s: pl.ds(s * bk, bk)
  for s in range(ns):
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hq, cols(s)], q_smem.at[s], landed)
    plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hq, cols(s)], k_smem.at[s], landed)
    plgpu.copy_gmem_to_smem(g_ref.at[b, rows, h, cols(s)], g_smem.at[s], landed)
  seg_r, cont, last = (bcast(vec(marks_ref.at[b, j, rows], wgmma.ROWS), 0) for j in range(3))
  same = seg_r == bcast(vec(marks_ref.at[b, 3, rows], wgmma.COLS), 1)
  rid, cid = iota()
  tril = (rid >= cid).astype(bf16)
  plgpu.barrier_wait(landed)

  ld = lambda ref: plgpu.load(ref, layout=wg).astype(f32)
  norms = []
  if cfg.use_qk_l2norm:
    norms = [lax.rsqrt(sum(jnp.sum(jnp.square(ld(x.at[s])), axis=1) for s in range(ns)) + L2_EPS)
             for x in (q_smem, k_smem)]
  n = cfg.diag_rows
  nb = c // n
  at = [i * n + n // 2 - 1 for i in range(nb)]  # the blocks' middle rows
  # a gate without a bound: exponents clamped (where the clamp bites, the chunk is redone)
  exp = (lambda x: jnp.exp(jnp.minimum(x, MAX_EXP))) if cfg.sub_chunks else jnp.exp
  regs = dt.itemsize == 2  # 16-bit row factors from registers (TF32 takes none)
  akk = aqk = span = None
  for s in range(ns):
    q, k, x = ld(q_smem.at[s]), ld(k_smem.at[s]), ld(g_smem.at[s])
    if norms:
      q, k = q * bcast(norms[0], 0), k * bcast(norms[1], 0)
    if cfg.gate is not None:
      x = gate(cfg, x, jnp.exp(alog_ref[h]), bcast(vec(dtb_ref.at[h, cols(s)], wgmma.COLS), 1))
    if t % c:  # padded tokens leave the state alone
      x = jnp.where(ci * c + rid < t, x, 0.0)

    # G = tril @ g on g's three bf16 parts; g's tile takes one (read already)
    own = (g_smem.at[s],) if dt == bf16 else ()
    G = scoped(lambda ones, *bufs, x=x: exact_products([(tril, x)], ones, *own, *bufs,
                                                       interpret=interpret),
               *[tile(bf16)] * (4 - len(own)))

    def references(g32):
      """The blocks' reference rows and G_C ([BK] each) through SMEM."""
      g32[...] = G
      plgpu.commit_smem()
      return [vec(g32.at[i], wgmma.COLS) for i in at + [c - 1]]

    *refs, gl = scoped(references, plgpu.SMEM((c, c), f32))
    gc_smem.at[cols(s)][...] = marks_ref[b, 1, ci * c + c - 1] * jnp.exp(gl)  # cont_last e^{G_C}
    # QG, KD, KG first: fewer tiles live through the products
    eg = jnp.exp(G)
    q_smem.at[s][...] = (cfg.scale * cont * q * eg).astype(dt)
    k_smem.at[s][...] = (last * k * jnp.exp(bcast(gl, 1) - G)).astype(dt)
    g_smem.at[s][...] = (eg * k).astype(dt)
    plgpu.commit_smem()
    for buf, out in ((q_smem, qg_ref), (k_smem, kd_ref), (g_smem, kg_ref)):
      plgpu.copy_smem_to_gmem(buf.at[s], out.at[b, rows, h, cols(s)])
    refs = [bcast(r, 1) for r in refs]
    ref_rows = refs[0]
    for i in range(1, nb):
      ref_rows = jnp.where(rid >= i * n, refs[i], ref_rows)
    if cfg.sub_chunks:
      far = jnp.max(jnp.abs(G - ref_rows), axis=1)
      span = far if span is None else jnp.maximum(span, far)
    e_row = exp(G - ref_rows)

    def products(*bufs, akk, aqk):
      """(P_kk, P_qk) with this slice's added (to fresh accumulators for the first): per block
      the column factor (zero from the block's end) in SMEM, the row factors masked to its
      rows from registers, every block at once; or (float32) from SMEM too, one block at a
      time."""
      ops, lhs = (bufs, (None, None)) if regs else (bufs[:1], bufs[1:])
      row_factors = ((k * e_row).astype(dt), (q * e_row).astype(dt))  # (16-bit: fewer registers)
      for blocks in ([range(nb)] if regs else [[i] for i in range(nb)]):
        if akk is not None:
          plgpu.commit_smem()  # the last products are done with the buffers
        pairs = ([], [])
        for j, i in enumerate(blocks):
          ops[j][...] = (k * jnp.where(rid < (i + 1) * n, exp(refs[i] - G), 0.0)).astype(dt)
          for a, pair, buf in zip(row_factors, pairs, lhs):
            a = jnp.where((rid >= i * n) & (rid < (i + 1) * n), a, jnp.zeros((), dt))
            if buf is not None:
              buf[...] = a
            pair.append((wgmma.Regs(a) if buf is None else buf, ops[j].T))
        plgpu.commit_smem()
        if akk is None:
          akk, aqk = wgmma.products(*(((c, c), pair) for pair in pairs), interpret=interpret)
        else:
          akk, aqk = wgmma.add_all((akk, pairs[0]), (aqk, pairs[1]), interpret=interpret)
      return akk, aqk

    akk, aqk = scoped(functools.partial(products, akk=akk, aqk=aqk),
                      *[tile(dt)] * (nb if regs else 3))

  def store(pkk_smem, a_smem):
    """P_kk, A_qk, gC and the per-row values by TMA."""
    pkk_smem[...] = jnp.where(same & (rid > cid), akk, 0.0)
    a_smem[...] = jnp.where(same & (rid >= cid), cfg.scale * aqk, 0.0).astype(dt)
    for j, v in enumerate(norms + ([span] if cfg.sub_chunks else [])):
      rows_smem.at[j][...] = v
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(pkk_smem, pkk_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(a_smem, a_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(gc_smem, gc_ref.at[b, ci, h])
    for j in range(n_rows):
      plgpu.copy_smem_to_gmem(rows_smem.at[j], rows_ref.at[b, h, j, rows])
    plgpu.wait_smem_to_gmem(0)

  scoped(store, plgpu.SMEM((c, c), f32), tile(dt))


def chunk_a(cfg: KdaOptions, q, k, g, A_log, dt_bias, seg, cont, t, *, hv: int,
            interpret: bool):
  """(pkk, aqk, qg, kd, kg, gc, rq, rk) and, on sub-chunks, the chunks to redo ``[B, Tp, HV]``
  (1 on their rows), as ``chunk_dense._dense_a_kernel`` writes them; ``cont`` ``[B, Tp]``
  float32 (1 where a token continues the state entering its chunk)."""
  bsz, tp, h, kd = q.shape
  c, nc, f32 = CHUNK, tp // CHUNK, jnp.float32
  dt = jnp.dtype(cfg.dtype)
  n_rows = 2 * cfg.use_qk_l2norm + cfg.sub_chunks
  tok = lambda d, dtype: jax.ShapeDtypeStruct((bsz, tp, hv, d), dtype)
  out_type = [tok(c, f32), tok(c, dt), tok(kd, dt), tok(kd, dt), tok(kd, dt),
              jax.ShapeDtypeStruct((bsz, nc, hv, kd), f32)]
  if n_rows:
    out_type.append(jax.ShapeDtypeStruct((bsz, hv, n_rows, tp), f32))
  kern = functools.partial(_kernel, cfg=cfg, hv=hv, group=hv // h, t=t, interpret=interpret)
  kern.__name__ = "kda_chunk_a_mgpu"
  tiles = wgmma.swizzled((kd // SLICE, c, SLICE), dt)
  scratch = (
      tiles,  # q in, QG out
      tiles,  # k in, KD out
      tiles,  # g in, a part of g, KG out
      plgpu.SMEM((kd,), f32),  # gC
      plgpu.SMEM((max(n_rows, 1), c), f32),  # the rows' norms and exponent spans
      plgpu.Barrier(num_arrivals=3 * (kd // SLICE)),
  )
  outs = plgpu.kernel(
      kern, out_type=tuple(out_type), scratch_types=scratch, grid=(nc, bsz * hv),
      grid_names=("c", "bh"), **wgmma.kernel_params(interpret))(
          q, k, g, A_log.astype(f32), dt_bias.astype(f32), marks(seg, cont))
  outs = [kernel_output(x) for x in outs]
  pkk, aqk, qg, kdec, kg, gc = outs[:6]
  per_row = [jnp.swapaxes(outs[6][:, :, j], 1, 2) for j in range(n_rows)]
  ones = jnp.ones((bsz, tp, hv), f32)
  rq, rk = per_row[:2] if cfg.use_qk_l2norm else (ones, ones)
  if not cfg.sub_chunks:
    return pkk, aqk, qg, kdec, kg, gc, rq, rk
  far = jnp.max(per_row[-1].reshape(bsz, nc, c, hv), axis=2)
  redo = jnp.repeat(jnp.where(far <= MAX_EXP, 0.0, 1.0), c, axis=1)
  return pkk, aqk, qg, kdec, kg, gc, rq, rk, redo
