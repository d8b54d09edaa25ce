"""``kda_chunk_a`` of the bounded gate's dense path as a Mosaic GPU kernel (Hopper: TMA, wgmma).

Same results as ``gpu._dense_a_kernel`` (Triton), per chunk of C = 64 tokens and K slice of 64
channels: the gate ``g = lower_bound * sigmoid(e^A_log (f + dt_bias))`` (zero on padded tokens),
its cumulative sum ``G`` over the chunk, the pair products ``P_kk = (k e^{G - r}) (k e^{r - G})^T``
and ``A_qk`` split at the middle row ``r`` of each block of ``diag_rows`` rows (bf16 products),
and the factors ``QG = scale cont q e^G``, ``KD = last k e^{G_C - G}``, ``KG = k e^G``,
``gC = cont_last e^{G_C}``. Where Triton scans for the cumulative sum and moves every product's
operands through shared memory, here the sum is a wgmma with the lower-triangular ones (``g``
split in three bf16 parts: exact to float32), the reference rows come from SMEM, and the pair
products take their left operands from registers. One warpgroup per (chunk, batch * value head),
99 KB of SMEM (two CTAs per SM). Not yet timed on a GPU (``gpu.CHUNK_A`` keeps Triton's).

Shapes: q, k ``[B, Tp, H, K]`` bf16 (of head ``h // group``), f ``[B, Tp, HV, K]`` bf16 (the raw
gate), gate ``[2, HV, K]`` float32 (``e^A_log`` and dt_bias per channel), rowf ``[4, B, Tp]``
float32 per token (``gpu._row_flags``): cont (continues the state entering its chunk), last (in
its chunk's last segment), cont of its chunk's last token, and the start of its segment within
its chunk (0 if before it); results as ``gpu._chunk_a``, the norms ``[B, HV, Tp]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kernel_output, wgmma
from pallas_kernels.kda.recurrence_mgpu import CHUNK
from pallas_kernels.kda.reference import L2_EPS

BK = CHUNK  # K slice (as wide as the chunk: one iota serves both)
_WG = plgpu.Layout.WGMMA


def supported(cfg, q) -> bool:
  """Bounded gate, bf16, 64-token chunks, K 64 or 128."""
  return (cfg.gate == "bounded" and cfg.chunk == CHUNK and q.dtype == jnp.bfloat16
          and cfg.dtype == "bfloat16" and q.shape[-1] in (64, 128) and cfg.diag_rows > 0)


def _split3(x):
  """x ~ a + b + c, three bf16 parts (float32 exactly)."""
  parts = []
  for _ in range(3):
    p = x.astype(jnp.bfloat16)
    parts.append(p)
    x = x - p.astype(jnp.float32)
  return parts


def _kernel(q_ref, k_ref, f_ref, gate_ref, rowf_ref,
            pkk_ref, aqk_ref, qg_ref, kd_ref, kg_ref, gc_ref, rq_ref, rk_ref,
            q_smem, k_smem, f_smem, gate_smem, rowf_smem, g_smem, kc_smem, out_smem, norm_smem,
            landed, *, cfg, hv, group, t, max_exp, interpret):
  c, f32, bf16 = CHUNK, jnp.float32, jnp.bfloat16
  ci, bh = lax.axis_index("c"), lax.axis_index("bh")
  b, h = lax.div(bh, hv), lax.rem(bh, hv)
  hq = lax.div(h, group)
  c0 = ci * c
  rows = pl.ds(c0, c)
  kdim = q_smem.shape[-1]
  for src, dst in ((q_ref.at[b, rows, hq], q_smem), (k_ref.at[b, rows, hq], k_smem),
                   (f_ref.at[b, rows, h], f_smem), (gate_ref.at[:, h], gate_smem),
                   (rowf_ref.at[:, b, rows], rowf_smem)):
    plgpu.copy_gmem_to_smem(src, dst, landed)
  plgpu.barrier_wait(landed)

  iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, (c, c), layout=_WG)
  rid, cid = iota(0), iota(1)
  # j <= i share a segment iff j is at or after the start of i's segment in the chunk
  same = cid.astype(f32) >= lax.broadcast_in_dim(plgpu.load(rowf_smem.at[3], layout=wgmma.ROWS),
                                                 (c, c), [0])
  valid = (rid + c0) < t
  rows_of = lambda ref: lax.broadcast_in_dim(plgpu.load(ref, layout=wgmma.ROWS), (c, c), [0])
  cols_of = lambda ref: lax.broadcast_in_dim(plgpu.load(ref, layout=wgmma.COLS), (c, c), [1])
  tile = lambda ref, s: plgpu.load(ref.at[:, pl.ds(s * BK, BK)], layout=_WG).astype(f32)
  ns = kdim // BK

  norms = []
  for ref in (q_smem, k_smem):
    if cfg.use_qk_l2norm:
      ss = sum(jnp.sum(jnp.square(tile(ref, s)), axis=1) for s in range(ns))
      norms.append(lax.rsqrt(ss + L2_EPS))
    else:
      norms.append(jnp.ones((c,), f32))
  tril = wgmma.Regs((rid >= cid).astype(bf16))
  cont, last, cont_last = (rows_of(rowf_smem.at[i]) for i in range(3))
  n = cfg.diag_rows
  akk = aqk = None
  for s in range(ns):
    cols = pl.ds(s * BK, BK)
    q = tile(q_smem, s) * lax.broadcast_in_dim(norms[0], (c, c), [0])
    k = tile(k_smem, s) * lax.broadcast_in_dim(norms[1], (c, c), [0])
    x = tile(f_smem, s) + cols_of(gate_smem.at[1, cols])
    g = cfg.lower_bound * jax.nn.sigmoid(cols_of(gate_smem.at[0, cols]) * x)
    g = jnp.where(valid, g, 0.0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous slice's stores read them
    for buf, part in zip(out_smem, _split3(g)):  # the output tiles hold the parts meanwhile
      buf[...] = part
    plgpu.commit_smem()
    G = wgmma.product((c, c), *[(tril, buf) for buf in out_smem], interpret=interpret)
    g_smem[...] = G
    plgpu.commit_smem()
    row = lambda i: lax.broadcast_in_dim(plgpu.load(g_smem.at[i], layout=wgmma.COLS), (c, c), [1])
    refs = [row(i * n + n // 2 - 1) for i in range(c // n)]
    ref_rows = refs[0]
    for i in range(1, len(refs)):
      ref_rows = jnp.where(rid >= i * n, refs[i], ref_rows)
    e_row = jnp.exp(G - ref_rows)
    lk, lq = (k * e_row).astype(bf16), (q * e_row).astype(bf16)  # bf16 operands: half the registers
    for i, ref in enumerate(refs):
      blk = (rid >= i * n) & (rid < (i + 1) * n)
      col = jnp.where(rid < (i + 1) * n, jnp.exp(jnp.minimum(ref - G, max_exp)), 0.0)
      kc_smem[...] = (k * col).astype(bf16)
      plgpu.commit_smem()
      pk, pq = wgmma.products(
          ((c, c), [(wgmma.Regs(jnp.where(blk, lk, jnp.zeros_like(lk))), kc_smem.T)]),
          ((c, c), [(wgmma.Regs(jnp.where(blk, lq, jnp.zeros_like(lq))), kc_smem.T)]),
          interpret=interpret)
      akk, aqk = (pk, pq) if akk is None else (akk + pk, aqk + pq)
    eg = jnp.exp(G)
    gl = row(c - 1)
    out_smem[0][...] = (cfg.scale * cont * q * eg).astype(bf16)
    out_smem[1][...] = (last * k * jnp.exp(gl - G)).astype(bf16)
    out_smem[2][...] = (eg * k).astype(bf16)
    g_smem[...] = cont_last * jnp.exp(gl)  # every row gC; its last row is stored
    plgpu.commit_smem()
    for buf, ref in zip(out_smem, (qg_ref, kd_ref, kg_ref)):
      plgpu.copy_smem_to_gmem(buf, ref.at[b, rows, h, cols])
    plgpu.copy_smem_to_gmem(g_smem.at[pl.ds(c - 1, 1)], gc_ref.at[b, pl.ds(ci, 1), h, cols])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # gC's store read g_smem
  pkk_smem, aqk_smem = g_smem, kc_smem
  pkk_smem[...] = jnp.where(same & (rid > cid), akk, 0.0)
  aqk_smem[...] = jnp.where(same & (rid >= cid), cfg.scale * aqk, 0.0).astype(bf16)
  for i, norm in enumerate(norms):
    norm_smem.at[i][...] = norm
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(pkk_smem, pkk_ref.at[b, rows, h])
  plgpu.copy_smem_to_gmem(aqk_smem, aqk_ref.at[b, rows, h])
  plgpu.copy_smem_to_gmem(norm_smem.at[0], rq_ref.at[b, h, rows])
  plgpu.copy_smem_to_gmem(norm_smem.at[1], rk_ref.at[b, h, rows])
  plgpu.wait_smem_to_gmem(0)


def chunk_a(cfg, q, k, f, gate, rowf, *, hv: int, t: int, max_exp: float, interpret: bool):
  """(pkk, aqk, qg, kd, kg, gc, rq, rk) as ``gpu._chunk_a`` returns them; see the module
  docstring. ``max_exp`` bounds the column factors' exponents (``gpu._MAX_EXP``)."""
  bsz, tp, h, kdim = q.shape
  c, f32, bf16 = CHUNK, jnp.float32, jnp.bfloat16
  tok = lambda d, dt: jax.ShapeDtypeStruct((bsz, tp, hv, d), dt)
  out_type = (tok(c, f32), tok(c, bf16), tok(kdim, bf16), tok(kdim, bf16), tok(kdim, bf16),
              jax.ShapeDtypeStruct((bsz, tp // c, hv, kdim), f32),
              jax.ShapeDtypeStruct((bsz, hv, tp), f32), jax.ShapeDtypeStruct((bsz, hv, tp), f32))
  kern = functools.partial(_kernel, cfg=cfg, hv=hv, group=hv // h, t=t, max_exp=max_exp,
                           interpret=interpret)
  kern.__name__ = "kda_chunk_a_mgpu"
  sw = functools.partial(wgmma.swizzled, dtype=bf16)
  scratch = (
      sw((c, kdim)), sw((c, kdim)), sw((c, kdim)),  # q, k, f
      plgpu.SMEM((2, kdim), f32),  # e^A_log, dt_bias
      plgpu.SMEM((4, c), f32),  # cont, last, cont_last, segment start
      plgpu.SMEM((c, BK), f32),  # G (its rows), then gC, then P_kk
      sw((c, BK)),  # k e^{r - G} of one block, then A_qk
      [sw((c, BK)) for _ in range(3)],  # the gate's three bf16 parts, then QG, KD, KG
      plgpu.SMEM((2, c), f32),  # the norms
      plgpu.Barrier(num_arrivals=5),
  )
  outs = plgpu.kernel(
      kern, out_type=out_type, scratch_types=scratch, grid=(tp // c, bsz * hv),
      grid_names=("c", "bh"), **wgmma.kernel_params(interpret))(q, k, f, gate, rowf)
  return tuple(kernel_output(x) for x in outs)
