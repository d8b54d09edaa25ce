"""The TPU (Mosaic) kernels of :mod:`.prefill`: forward, and the backward's dK/dV and dQ kernels.

Layout [B, H, T, D]; the key (or query) loop is the last grid axis ("arbitrary") with the
accumulators in VMEM scratch. Skipped blocks keep the previous block index (no new DMA).
Segment ids travel as [B, Tp, 1] (query side) and [B, 1, Sp] (key side). Two scalar-prefetch
inputs: the flattened block table and the [1] query offset (index maps take both, last).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla.blocks import Static, block_tables, element_mask, query_offset
from pallas_kernels.mla.common import LOG2E, dot, finish, grad_step, scores, softmax_step


def _tpu_clamped(tab_ref, base, j):
  """Block index for grid step j: clamped into [lo, hi) so skipped steps fetch nothing new."""
  lo, hi = tab_ref[base], tab_ref[base + 3]
  return jnp.clip(j, lo, jnp.maximum(hi - 1, lo))


def _tpu_when_visible(tab_ref, base, j, compute):
  """Calls ``compute(masked)`` when step j lies in ``[lo, hi)``: unmasked inside ``[a, b)``."""
  lo, a, b, hi = (tab_ref[base + r] for r in range(4))
  visit = (j >= lo) & (j < hi)
  full = (j >= a) & (j < b)
  pl.when(visit & full)(lambda: compute(False))
  pl.when(visit & jnp.logical_not(full))(lambda: compute(True))


def _tpu_block_mask(i, j, bq, bk, st: Static, off, qseg_ref, kseg_ref):
  """``[bq, bk]`` bool mask of query block i against key block j (causal at query offset off,
  key padding, and segments when the segment refs are given)."""
  qpos = i * bq + off + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  kpos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  qseg, kseg = (qseg_ref[...], kseg_ref[...]) if qseg_ref is not None else (None, None)
  return element_mask(qpos, kpos, qseg, kseg, causal=st.causal, s=st.s)


def _tpu_fwd_kernel(tab_ref, off_ref, q_ref, k_ref, v_ref, *rest, st: Static, nq: int, nk: int,
                    segmented: bool):
  if segmented:
    qseg_ref, kseg_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
  else:
    o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    qseg_ref = kseg_ref = None
  bq, bk = st.blocks.fwd_q, st.blocks.fwd_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  base = ((b if segmented else 0) * nq + i) * 4

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def compute(masked):
    s = scores([q_ref[...]], [k_ref[...]], st.scale * LOG2E)
    if masked:
      mask = _tpu_block_mask(i, j, bq, bk, st, query_offset(st, off_ref), qseg_ref, kseg_ref)
      s = jnp.where(mask, s, -jnp.inf)
    m, l, (acc,) = softmax_step(s, m_ref[...], l_ref[...], (acc_ref[...],), [v_ref[...]])
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  _tpu_when_visible(tab_ref, base, j, compute)

  @pl.when(j == nk - 1)
  def _():
    (out,), lse = finish(m_ref[...], l_ref[...], (acc_ref[...],))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _tpu_dkv_kernel(tab_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                    st: Static, nq: int, nk: int, segmented: bool):
  if segmented:
    qseg_ref, kseg_ref, dk_ref, dv_ref, dk_acc, dv_acc = rest
  else:
    dk_ref, dv_ref, dk_acc, dv_acc = rest
    qseg_ref = kseg_ref = None
  bq, bk = st.blocks.dkv_q, st.blocks.dkv_k
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  base = ((b if segmented else 0) * nk + j) * 4

  @pl.when(i == 0)
  def _():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def compute(masked):
    mask = (_tpu_block_mask(i, j, bq, bk, st, query_offset(st, off_ref), qseg_ref, kseg_ref)
            if masked else None)
    q, do = q_ref[...], do_ref[...]
    p, ds = grad_step([q], [k_ref[...]], [v_ref[...]], [do], lse_ref[...], delta_ref[...], mask,
                       st.scale * LOG2E)
    dv_acc[...] += dot(p.T.astype(do.dtype), do)
    dk_acc[...] += dot(ds.T.astype(q.dtype), q)

  _tpu_when_visible(tab_ref, base, i, compute)

  @pl.when(i == nq - 1)
  def _():
    dk_ref[...] = (dk_acc[...] * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _tpu_dq_kernel(tab_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                   st: Static, nq: int, nk: int, segmented: bool):
  if segmented:
    qseg_ref, kseg_ref, dq_ref, dq_acc = rest
  else:
    dq_ref, dq_acc = rest
    qseg_ref = kseg_ref = None
  bq, bk = st.blocks.dq_q, st.blocks.dq_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  base = ((b if segmented else 0) * nq + i) * 4

  @pl.when(j == 0)
  def _():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  def compute(masked):
    mask = (_tpu_block_mask(i, j, bq, bk, st, query_offset(st, off_ref), qseg_ref, kseg_ref)
            if masked else None)
    k = k_ref[...]
    _, ds = grad_step([q_ref[...]], [k], [v_ref[...]], [do_ref[...]], lse_ref[...],
                       delta_ref[...], mask, st.scale * LOG2E)
    dq_acc[...] += dot(ds.astype(k.dtype), k)

  _tpu_when_visible(tab_ref, base, j, compute)

  @pl.when(j == nk - 1)
  def _():
    dq_ref[...] = (dq_acc[...] * st.scale).astype(dq_ref.dtype)


def _tpu_call(kernel, tab, off, args, in_specs, out_specs, out_shape, scratch, grid, st, name):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if st.interpret else False,
      name=name)(tab.reshape(-1), off[None], *args)


def _tpu_seg_args(qseg, kseg):
  return [] if qseg is None else [qseg[:, :, None], kseg[:, None, :]]


def forward(q, k, v, qseg, kseg, off, st: Static):
  """q ``[B, H, Tp, Dk]`` (TPU layout) -> o ``[B, H, Tp, Dv]``, lse ``[B, H, Tp, 1]``."""
  b, h, tp, dk = q.shape
  sp, dv = k.shape[2], v.shape[-1]
  bq, bk = st.blocks.fwd_q, st.blocks.fwd_k
  nq, nk = tp // bq, sp // bk
  segmented = qseg is not None
  rows, _ = block_tables(qseg, kseg, t=st.t, s=st.s, tp=tp, sp=sp, bq=bq, bk=bk,
                         causal=st.causal, off=off)
  base = lambda bi, i: ((bi if segmented else 0) * nq + i) * 4
  kv_idx = lambda bi, hi, i, j, tab, _: (bi, hi, _tpu_clamped(tab, base(bi, i), j), 0)
  q_idx = lambda bi, hi, i, j, tab, _: (bi, hi, i, 0)
  in_specs = [pl.BlockSpec((None, None, bq, dk), q_idx), pl.BlockSpec((None, None, bk, dk), kv_idx),
              pl.BlockSpec((None, None, bk, dv), kv_idx)]
  if segmented:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j, tab, _: (bi, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j, tab, _:
                              (bi, 0, _tpu_clamped(tab, base(bi, i), j)))]
  kernel = functools.partial(_tpu_fwd_kernel, st=st, nq=nq, nk=nk, segmented=segmented)
  return _tpu_call(
      kernel, rows, off, [q, k, v, *_tpu_seg_args(qseg, kseg)], in_specs,
      [pl.BlockSpec((None, None, bq, dv), q_idx), pl.BlockSpec((None, None, bq, 1), q_idx)],
      [jax.ShapeDtypeStruct((b, h, tp, dv), q.dtype),
       jax.ShapeDtypeStruct((b, h, tp, 1), jnp.float32)],
      [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
       pltpu.VMEM((bq, dv), jnp.float32)],
      (b, h, nq, nk), st, "mla_fwd")


def backward(q, k, v, qseg, kseg, off, o, lse, do, dlse, st: Static):
  """All in TPU layout ``[B, H, T, D]``; lse and its cotangent dlse ``[B, H, Tp, 1]``."""
  b, h, tp, dk = q.shape
  sp, dv = k.shape[2], v.shape[-1]
  delta = (jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1, keepdims=True)
           - dlse * LOG2E)
  segmented = qseg is not None
  seg_args = _tpu_seg_args(qseg, kseg)
  tables = functools.partial(block_tables, qseg, kseg, t=st.t, s=st.s, tp=tp, sp=sp,
                             causal=st.causal, off=off)

  bq, bk = st.blocks.dkv_q, st.blocks.dkv_k
  nq, nk = tp // bq, sp // bk
  _, cols = tables(bq=bq, bk=bk)
  base = lambda bi, j: ((bi if segmented else 0) * nk + j) * 4
  q_idx = lambda bi, hi, j, i, tab, _: (bi, hi, _tpu_clamped(tab, base(bi, j), i), 0)
  kv_idx = lambda bi, hi, j, i, tab, _: (bi, hi, j, 0)
  in_specs = [pl.BlockSpec((None, None, bq, dk), q_idx), pl.BlockSpec((None, None, bk, dk), kv_idx),
              pl.BlockSpec((None, None, bk, dv), kv_idx), pl.BlockSpec((None, None, bq, dv), q_idx),
              pl.BlockSpec((None, None, bq, 1), q_idx), pl.BlockSpec((None, None, bq, 1), q_idx)]
  if segmented:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda bi, hi, j, i, tab, _:
                              (bi, _tpu_clamped(tab, base(bi, j), i), 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, hi, j, i, tab, _: (bi, 0, j))]
  dk_, dv_ = _tpu_call(
      functools.partial(_tpu_dkv_kernel, st=st, nq=nq, nk=nk, segmented=segmented), cols, off,
      [q, k, v, do, lse, delta, *seg_args], in_specs,
      [pl.BlockSpec((None, None, bk, dk), kv_idx), pl.BlockSpec((None, None, bk, dv), kv_idx)],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      [pltpu.VMEM((bk, dk), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)],
      (b, h, nk, nq), st, "mla_bwd_dkv")

  bq, bk = st.blocks.dq_q, st.blocks.dq_k
  nq, nk = tp // bq, sp // bk
  rows, _ = tables(bq=bq, bk=bk)
  base = lambda bi, i: ((bi if segmented else 0) * nq + i) * 4
  q_idx = lambda bi, hi, i, j, tab, _: (bi, hi, i, 0)
  kv_idx = lambda bi, hi, i, j, tab, _: (bi, hi, _tpu_clamped(tab, base(bi, i), j), 0)
  in_specs = [pl.BlockSpec((None, None, bq, dk), q_idx), pl.BlockSpec((None, None, bk, dk), kv_idx),
              pl.BlockSpec((None, None, bk, dv), kv_idx), pl.BlockSpec((None, None, bq, dv), q_idx),
              pl.BlockSpec((None, None, bq, 1), q_idx), pl.BlockSpec((None, None, bq, 1), q_idx)]
  if segmented:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j, tab, _: (bi, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j, tab, _:
                              (bi, 0, _tpu_clamped(tab, base(bi, i), j)))]
  dq = _tpu_call(
      functools.partial(_tpu_dq_kernel, st=st, nq=nq, nk=nk, segmented=segmented), rows, off,
      [q, k, v, do, lse, delta, *seg_args], in_specs,
      pl.BlockSpec((None, None, bq, dk), q_idx), jax.ShapeDtypeStruct(q.shape, q.dtype),
      [pltpu.VMEM((bq, dk), jnp.float32)], (b, h, nq, nk), st, "mla_bwd_dq")
  return dq, dk_, dv_

