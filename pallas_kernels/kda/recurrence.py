"""The chunked KDA's sequential passes over chunks, Pallas GPU.

``_fwd_kernel`` (grid (V tiles, B*HV), sequential over chunks): the state tile ``S [K, BV]``
stays in registers; per chunk ``V' = U - W S``, ``O = QG S + A_qk V'``,
``S = gC * S + KD^T V'``. ``_bwd_kernel`` carries ``dS`` backwards and writes ``dV'`` and the
state gradients. :func:`recurrence_fwd` / :func:`recurrence_bwd` take the Mosaic GPU passes of
``recurrence_mgpu`` instead where the tuning asks for them (``KdaGpuConfig.recurrence``) and they
take the operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import recurrence_mgpu
from pallas_kernels.kda.config import KdaOptions, compiler_params, interpret, stages, store_dtype


def _dot(a, b, trans_a=False):
  dims = (((0,), (0,)), ((), ())) if trans_a else (((1,), (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _fwd_kernel(w_ref, u_ref, qg_ref, a_ref, kd_ref, gc_ref, s0_ref, o_ref, st_ref, *rest,
                nc, hv, c, bv, store, every):
  """Grid (V/BV, B*HV): the V tiles of one head side by side (the first grid axis is launched
  fastest), so when the programs take several waves each chunk's factors, which all V tiles of
  the head read, still come from L2 after the first. o ``[B, Tp, HV, V]``, st
  ``[B, HV, K, V]``; with ``store`` also h ``[B, NC, HV, K, V]`` (state entering each chunk)
  and vn ``[B, Tp, HV, V]`` (V' as the products take it, in the kernels' dtype); with ``every``
  last the states after every ``every`` chunks ``[B, max(NC // every, 1), HV, K, V]`` float32."""
  iv, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  vs = pl.ds(iv * bv, bv)
  dt = w_ref.dtype

  def body(ci, s):
    rows = pl.ds(ci * c, c)
    if store:
      rest[0][b, ci, h, :, vs] = s.astype(rest[0].dtype)
    sb = s.astype(dt)
    vn = u_ref[b, rows, h, vs].astype(jnp.float32) - _dot(w_ref[b, rows, h, :], sb)
    vnb = vn.astype(dt)
    o_ref[b, rows, h, vs] = (_dot(qg_ref[b, rows, h, :], sb)
                             + _dot(a_ref[b, rows, h, :], vnb)).astype(o_ref.dtype)
    if store:
      rest[1][b, rows, h, vs] = vnb
    s = gc_ref[b, ci, h, :][:, None] * s + _dot(kd_ref[b, rows, h, :], vnb, trans_a=True)
    if every:
      m = jax.lax.div(ci + 1, jnp.int32(every))  # int32: the loop index's type

      @pl.when(m * every == ci + 1)
      def _():
        rest[-1][b, m - 1, h, :, vs] = s
    return s

  s = jax.lax.fori_loop(0, nc, body, s0_ref[b, h, :, vs].astype(jnp.float32))
  st_ref[b, h, :, vs] = s


def _bwd_kernel(do_ref, qg_ref, a_ref, kd_ref, w_ref, gc_ref, dst_ref, dvn_ref, dh_ref, ds0_ref,
                *, nc, hv, c, bv):
  """Reverse pass, grid (V/BV, B*HV) as the forward's. dvn ``[B, Tp, HV, V]`` (gradient of V'),
  dh ``[B, NC, HV, K, V]`` (gradient of the state leaving each chunk), ds0 ``[B, HV, K, V]``."""
  iv, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  vs = pl.ds(iv * bv, bv)
  dt = w_ref.dtype

  def body(i, ds):
    ci = nc - 1 - i
    rows = pl.ds(ci * c, c)
    dh_ref[b, ci, h, :, vs] = ds.astype(dh_ref.dtype)
    do = do_ref[b, rows, h, vs].astype(dt)
    dvn = _dot(a_ref[b, rows, h, :], do, trans_a=True) + _dot(kd_ref[b, rows, h, :], ds.astype(dt))
    dvn_ref[b, rows, h, vs] = dvn.astype(dvn_ref.dtype)
    return (gc_ref[b, ci, h, :][:, None] * ds + _dot(qg_ref[b, rows, h, :], do, trans_a=True)
            - _dot(w_ref[b, rows, h, :], dvn.astype(dt), trans_a=True))

  ds = jax.lax.fori_loop(0, nc, body, dst_ref[b, h, :, vs].astype(jnp.float32))
  ds0_ref[b, h, :, vs] = ds


def recur_stages(cfg, c, kdim, bv, factor, tile):
  """Stages of a sequential pass whose chunk step loads three [C, K] factors and A_qk [C, C] of
  ``factor``'s dtype and one [C, BV] tile of ``tile``'s."""
  return stages(cfg.tuning.recur_stages, factor.dtype.itemsize * c * (3 * kdim + c)
                + tile.dtype.itemsize * c * bv)


def mosaic_tile(cfg: KdaOptions, w, tile, *stored, forward=False) -> int:
  """The V tile of the Mosaic GPU pass for these operands (``tile``: U or dO; ``stored``: the
  dtypes the pass writes), or 0 for Triton's."""
  bv = min(cfg.tuning.mgpu_v_tile, tile.shape[-1])
  wanted = cfg.tuning.recurrence == "mosaic" or (cfg.tuning.recurrence == "backward"
                                                 and not forward)
  ok = (wanted and tile.shape[-1] % bv == 0
        and recurrence_mgpu.supported(w, tile, cfg.chunk, *stored))
  return bv if ok else 0


def recurrence_fwd(cfg: KdaOptions, w, u, qg, aqk, kd, gc, s0, out_dtype, store, every=0):
  """(o ``[B, Tp, HV, V]``, final state ``[B, HV, K, V]`` float32), with ``store`` the states
  entering each chunk ``[B, NC, HV, K, V]`` and V' ``[B, Tp, HV, V]``, and with ``every`` last
  the states after every ``every`` chunks ``[B, max(NC // every, 1), HV, K, V]`` float32."""
  bsz, tp, hv, kdim = w.shape
  vd = u.shape[-1]
  c, nc = cfg.chunk, tp // cfg.chunk
  bv = mosaic_tile(cfg, w, u, *([store_dtype(cfg, "h")] if store else []), forward=True)
  if bv:
    return recurrence_mgpu.recurrence_fwd(w, u, qg, aqk, kd, gc, s0, out_dtype=out_dtype,
                                          store=store, block_v=bv, every=every,
                                          stages=cfg.tuning.mgpu_stages, interpret=interpret())
  bv = min(cfg.tuning.v_tile, vd)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), out_dtype),
               jax.ShapeDtypeStruct((bsz, hv, kdim, vd), f32)]
  if store:  # the states (``bf16_stores``) and V' in the kernels' dtype, as this kernel's
    # products take it (bf16: half the bytes). The dense backward rounds V' to bf16 anyway (the
    # same results); the general path's three-pass products see the value the forward used
    out_shape += [jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), store_dtype(cfg, "h")),
                  jax.ShapeDtypeStruct((bsz, tp, hv, vd), w.dtype)]
  if every:
    out_shape.append(jax.ShapeDtypeStruct((bsz, max(nc // every, 1), hv, kdim, vd), f32))
  kern = functools.partial(_fwd_kernel, nc=nc, hv=hv, c=c, bv=bv, store=store, every=every)
  return pl.pallas_call(
      kern, out_shape=out_shape, grid=(vd // bv, bsz * hv),
      compiler_params=compiler_params(num_stages=recur_stages(cfg, c, kdim, bv, w, u)),
      interpret=interpret(), name="kda_fwd_recurrence")(w, u, qg, aqk, kd, gc, s0)


def recurrence_bwd(cfg: KdaOptions, do, qg, aqk, kd, w, gc, dst):
  """(dV' ``[B, Tp, HV, V]``, the gradients of the states leaving each chunk
  ``[B, NC, HV, K, V]``, of the initial state ``[B, HV, K, V]`` float32)."""
  bsz, tp, hv, kdim = w.shape
  vd = do.shape[-1]
  c, nc = cfg.chunk, tp // cfg.chunk
  bv = mosaic_tile(cfg, w, do, store_dtype(cfg, "dvn"), store_dtype(cfg, "dh"))
  if bv:
    return recurrence_mgpu.recurrence_bwd(do, qg, aqk, kd, w, gc, dst, block_v=bv,
                                          stages=cfg.tuning.mgpu_stages, interpret=interpret())
  bv = min(cfg.tuning.v_tile, vd)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), store_dtype(cfg, "dvn")),
               jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), store_dtype(cfg, "dh")),
               jax.ShapeDtypeStruct((bsz, hv, kdim, vd), f32)]
  kern = functools.partial(_bwd_kernel, nc=nc, hv=hv, c=c, bv=bv)
  return pl.pallas_call(
      kern, out_shape=out_shape, grid=(vd // bv, bsz * hv),
      compiler_params=compiler_params(num_stages=recur_stages(cfg, c, kdim, bv, w, do)),
      interpret=interpret(), name="kda_bwd_recurrence")(do, qg, aqk, kd, w, gc, dst)
