"""Flash attention with MLA's shapes (query/key dim != value dim) as Pallas kernels, GPU and TPU.

Forward and backward (``jax.custom_vjp``), causal or not, packed documents as segment ids, bf16
inputs with float32 accumulation, no padding of the head dims: Dk = 192 runs as two matmuls of
128 + 64 (Triton wants power-of-two tiles), any dim that is a multiple of 16 works.

A query window may sit anywhere in longer keys (context parallelism): query row i is at key
position ``q_offset + i`` (``q_offset`` an int32 scalar, possibly traced; by default ``S - T``,
the last query with the last key), and queries and keys carry their own segment ids. The offset
enters the block tables (computed in JAX) and reaches the kernels as one int32 scalar.

Block skipping: the wrapper classifies every (query block, key block) pair from the causal
diagonal, key padding and per-block min/max segment ids as *skipped* (nothing visible), *full*
(everything visible: no element mask) or *partial*. Each row of blocks is summarised as
``[lo, a, b, hi)``: only blocks in ``[lo, hi)`` are visited, ``[a, b)`` (the first run of full
blocks) without a mask, the rest with one. With sorted (packed) segment ids this visits exactly
the blocks that intersect the query block's documents.

Softmax runs in base 2 (scores pre-multiplied by ``scale * log2(e)``); the forward saves the
base-2 log-sum-exp ``[B, H, T]`` (``+inf`` for rows that see no key, so their probabilities are 0).
With ``return_lse`` it is also an output (natural log, ``-inf`` for those rows), differentiable:
its cotangent ``g`` enters the backward as ``delta - g`` (``dS = P (dP - delta + g)``), so
attention over key blocks can be merged outside the kernel (``sharding.context_parallel``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import default_backend
from pallas_kernels.mla import prefill_tpu
from pallas_kernels.mla.blocks import (GPU_BLOCKS, TPU_BLOCKS, Blocks, Static, block_tables,
                                       element_mask, query_offset)
from pallas_kernels.mla.common import (LOG2E, dot, finish, gpu_params, grad_step, pow2_parts,
                                       scores, softmax_step)


# --------------------------------------------------------------------------- GPU (Triton)


def _three_loops(tab_ref, body, carry):
  """``body(j, carry, masked)`` over ``[lo, a)`` masked, ``[a, b)`` plain, ``[b, hi)`` masked."""
  lo, a, b, hi = tab_ref[0], tab_ref[1], tab_ref[2], tab_ref[3]
  carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
  return lax.fori_loop(b, hi, functools.partial(body, masked=True), carry)


def _gpu_refs(rest, segmented):
  """``(qseg_ref, kseg_ref), outputs`` from a kernel's trailing refs."""
  return (tuple(rest[:2]), rest[2:]) if segmented else ((None, None), rest)


def _gpu_fwd_kernel(tab_ref, off_ref, q_ref, k_ref, v_ref, *rest, st: Static, nq: int,
                    dk_parts, dv_parts, segmented: bool):
  (qseg_ref, kseg_ref), (o_ref, lse_ref) = _gpu_refs(rest, segmented)
  bq, bk = st.blocks.fwd_q, st.blocks.fwd_k
  i = nq - 1 - pl.program_id(0)
  scale2 = st.scale * LOG2E
  q_parts = [q_ref[:, pl.ds(o, n)] for o, n in dk_parts]
  qpos = (i * bq + query_offset(st, off_ref) + jnp.arange(bq))[:, None]
  qseg = qseg_ref[pl.ds(i * bq, bq)][:, None] if segmented else None

  def body(j, carry, masked):
    m, l, accs = carry
    rows = pl.ds(j * bk, bk)
    s = scores(q_parts, [k_ref[rows, pl.ds(o, n)] for o, n in dk_parts], scale2)
    if masked:
      kpos = (j * bk + jnp.arange(bk))[None, :]
      kseg = kseg_ref[rows][None, :] if segmented else None
      s = jnp.where(element_mask(qpos, kpos, qseg, kseg, causal=st.causal, s=st.s), s, -jnp.inf)
    return softmax_step(s, m, l, accs, [v_ref[rows, pl.ds(o, n)] for o, n in dv_parts])

  init = (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          tuple(jnp.zeros((bq, n), jnp.float32) for _, n in dv_parts))
  m, l, accs = _three_loops(tab_ref, body, init)
  outs, lse = finish(m, l, accs)
  for (o, n), out in zip(dv_parts, outs):
    o_ref[:, pl.ds(o, n)] = out.astype(o_ref.dtype)
  lse_ref[...] = lse[:, 0]


def _gpu_dkv_kernel(tab_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                    st: Static, dk_parts, dv_parts, segmented: bool):
  """dK, dV of one key block, computed transposed (``[bk, bq]`` scores: no register transposes)."""
  (qseg_ref, kseg_ref), (dk_ref, dv_ref) = _gpu_refs(rest, segmented)
  bq, bk = st.blocks.dkv_q, st.blocks.dkv_k
  j = pl.program_id(0)
  scale2 = st.scale * LOG2E
  off = query_offset(st, off_ref)
  k_parts = [k_ref[:, pl.ds(o, n)] for o, n in dk_parts]
  v_parts = [v_ref[:, pl.ds(o, n)] for o, n in dv_parts]
  kpos = (j * bk + jnp.arange(bk))[:, None]
  kseg = kseg_ref[pl.ds(j * bk, bk)][:, None] if segmented else None

  def body(i, carry, masked):
    dks, dvs = carry
    rows = pl.ds(i * bq, bq)
    q_parts = [q_ref[rows, pl.ds(o, n)] for o, n in dk_parts]
    do_parts = [do_ref[rows, pl.ds(o, n)] for o, n in dv_parts]
    mask = None
    if masked:
      qpos = (i * bq + off + jnp.arange(bq))[None, :]
      qseg = qseg_ref[rows][None, :] if segmented else None
      mask = element_mask(qpos, kpos, qseg, kseg, causal=st.causal, s=st.s)
    # transposed roles: scores K Q^T, dP^T = V dO^T
    pt, dst = grad_step(k_parts, q_parts, do_parts, v_parts, lse_ref[rows][None, :],
                         delta_ref[rows][None, :], mask, scale2)
    pt = pt.astype(do_ref.dtype)
    dst = dst.astype(q_ref.dtype)
    dvs = tuple(acc + dot(pt, dc) for acc, dc in zip(dvs, do_parts))
    dks = tuple(acc + dot(dst, qc) for acc, qc in zip(dks, q_parts))
    return dks, dvs

  init = (tuple(jnp.zeros((bk, n), jnp.float32) for _, n in dk_parts),
          tuple(jnp.zeros((bk, n), jnp.float32) for _, n in dv_parts))
  dks, dvs = _three_loops(tab_ref, body, init)
  for (o, n), acc in zip(dk_parts, dks):
    dk_ref[:, pl.ds(o, n)] = (acc * st.scale).astype(dk_ref.dtype)
  for (o, n), acc in zip(dv_parts, dvs):
    dv_ref[:, pl.ds(o, n)] = acc.astype(dv_ref.dtype)


def _gpu_dq_kernel(tab_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                   st: Static, nq: int, dk_parts, dv_parts, segmented: bool):
  (qseg_ref, kseg_ref), (dq_ref,) = _gpu_refs(rest, segmented)
  bq, bk = st.blocks.dq_q, st.blocks.dq_k
  i = nq - 1 - pl.program_id(0)
  scale2 = st.scale * LOG2E
  q_parts = [q_ref[:, pl.ds(o, n)] for o, n in dk_parts]
  do_parts = [do_ref[:, pl.ds(o, n)] for o, n in dv_parts]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  qpos = (i * bq + query_offset(st, off_ref) + jnp.arange(bq))[:, None]
  qseg = qseg_ref[pl.ds(i * bq, bq)][:, None] if segmented else None

  def body(j, dqs, masked):
    rows = pl.ds(j * bk, bk)
    k_parts = [k_ref[rows, pl.ds(o, n)] for o, n in dk_parts]
    mask = None
    if masked:
      kpos = (j * bk + jnp.arange(bk))[None, :]
      kseg = kseg_ref[rows][None, :] if segmented else None
      mask = element_mask(qpos, kpos, qseg, kseg, causal=st.causal, s=st.s)
    _, ds = grad_step(q_parts, k_parts, [v_ref[rows, pl.ds(o, n)] for o, n in dv_parts],
                       do_parts, lse, delta, mask, scale2)
    dsb = ds.astype(k_ref.dtype)
    return tuple(acc + dot(dsb, kc) for acc, kc in zip(dqs, k_parts))

  dqs = _three_loops(tab_ref, body, tuple(jnp.zeros((bq, n), jnp.float32) for _, n in dk_parts))
  for (o, n), acc in zip(dk_parts, dqs):
    dq_ref[:, pl.ds(o, n)] = (acc * st.scale).astype(dq_ref.dtype)


def _gpu_seg_specs(qseg, kseg):
  """Whole-row specs and arrays of the query and key segment ids (none when unsegmented)."""
  if qseg is None:
    return [], []
  spec = lambda n: pl.BlockSpec((None, n), lambda g, bi, hi: (bi, 0))
  return [spec(qseg.shape[1]), spec(kseg.shape[1])], [qseg, kseg]


_GPU_OFF = pl.BlockSpec((1,), lambda g, bi, hi: (0,))  # the [1] int32 query offset


def _gpu_fwd(q, k, v, qseg, kseg, off, st: Static):
  b, tp, h, dk = q.shape
  sp, dv = k.shape[1], v.shape[-1]
  bq, bk = st.blocks.fwd_q, st.blocks.fwd_k
  nq = tp // bq
  rows, _ = block_tables(qseg, kseg, t=st.t, s=st.s, tp=tp, sp=sp, bq=bq, bk=bk,
                         causal=st.causal, off=off)
  segmented = qseg is not None
  bsel = (lambda bi: bi) if segmented else (lambda bi: 0)
  seg_specs, seg_args = _gpu_seg_specs(qseg, kseg)
  in_specs = [
      pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bsel(bi), nq - 1 - i, 0)), _GPU_OFF,
      pl.BlockSpec((None, bq, None, dk), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0)),
      pl.BlockSpec((None, sp, None, dk), lambda i, bi, hi: (bi, 0, hi, 0)),
      pl.BlockSpec((None, sp, None, dv), lambda i, bi, hi: (bi, 0, hi, 0)),
      *seg_specs,
  ]
  kernel = functools.partial(_gpu_fwd_kernel, st=st, nq=nq, dk_parts=pow2_parts(dk),
                             dv_parts=pow2_parts(dv), segmented=segmented)
  return pl.pallas_call(
      kernel, grid=(nq, b, h), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bq, None, dv), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, nq - 1 - i))],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
      compiler_params=gpu_params(st.blocks.fwd_warps, st.blocks.fwd_stages),
      interpret=st.interpret, name="mla_fwd")(rows, off[None], q, k, v, *seg_args)


def _gpu_bwd(q, k, v, qseg, kseg, off, o, lse, do, dlse, st: Static):
  """dlse: the cotangent of the base-2 log-sum-exp ``[B, H, Tp]``."""
  b, tp, h, dk = q.shape
  sp, dv = k.shape[1], v.shape[-1]
  delta = (jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
           - dlse * LOG2E)
  segmented = qseg is not None
  bsel = (lambda bi: bi) if segmented else (lambda bi: 0)
  parts = dict(dk_parts=pow2_parts(dk), dv_parts=pow2_parts(dv), segmented=segmented)
  seg_specs, seg_args = _gpu_seg_specs(qseg, kseg)
  tables = functools.partial(block_tables, qseg, kseg, t=st.t, s=st.s, tp=tp, sp=sp,
                             causal=st.causal, off=off)

  bq, bk = st.blocks.dkv_q, st.blocks.dkv_k
  nk = sp // bk
  _, cols = tables(bq=bq, bk=bk)
  whole = lambda n, d: pl.BlockSpec((None, n, None, d), lambda j, bi, hi: (bi, 0, hi, 0))
  tile = lambda n, d: pl.BlockSpec((None, n, None, d), lambda j, bi, hi: (bi, j, hi, 0))
  row = pl.BlockSpec((None, None, tp), lambda j, bi, hi: (bi, hi, 0))
  in_specs = [pl.BlockSpec((None, None, 4), lambda j, bi, hi: (bsel(bi), j, 0)), _GPU_OFF,
              whole(tp, dk), tile(bk, dk), tile(bk, dv), whole(tp, dv), row, row, *seg_specs]
  dk_, dv_ = pl.pallas_call(
      functools.partial(_gpu_dkv_kernel, st=st, **parts),
      grid=(nk, b, h), in_specs=in_specs, out_specs=[tile(bk, dk), tile(bk, dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=gpu_params(st.blocks.dkv_warps, st.blocks.dkv_stages),
      interpret=st.interpret, name="mla_bwd_dkv")(cols, off[None], q, k, v, do, lse, delta,
                                                  *seg_args)

  bq, bk = st.blocks.dq_q, st.blocks.dq_k
  nq = tp // bq
  rows, _ = tables(bq=bq, bk=bk)
  whole = lambda n, d: pl.BlockSpec((None, n, None, d), lambda i, bi, hi: (bi, 0, hi, 0))
  tile = lambda n, d: pl.BlockSpec((None, n, None, d), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0))
  row = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, nq - 1 - i))
  in_specs = [pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bsel(bi), nq - 1 - i, 0)),
              _GPU_OFF, tile(bq, dk), whole(sp, dk), whole(sp, dv), tile(bq, dv), row, row,
              *seg_specs]
  dq = pl.pallas_call(
      functools.partial(_gpu_dq_kernel, st=st, nq=nq, **parts),
      grid=(nq, b, h), in_specs=in_specs, out_specs=tile(bq, dk),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=gpu_params(st.blocks.dq_warps, st.blocks.dq_stages),
      interpret=st.interpret, name="mla_bwd_dq")(rows, off[None], q, k, v, do, lse, delta,
                                                 *seg_args)
  return dq, dk_, dv_


# --------------------------------------------------------------------------- custom_vjp


def _to_tpu(x):
  return x.transpose(0, 2, 1, 3)  # [B, T, H, D] <-> [B, H, T, D]


def _forward(q, k, v, qseg, kseg, off, st: Static):
  if st.backend == "gpu":
    return _gpu_fwd(q, k, v, qseg, kseg, off, st)
  o, lse = prefill_tpu.forward(_to_tpu(q), _to_tpu(k), _to_tpu(v), qseg, kseg, off, st)
  return _to_tpu(o), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, qseg, kseg, off, st: Static):
  """Padded q ``[B, Tp, H, Dk]``, k ``[B, Sp, H, Dk]``, v ``[B, Sp, H, Dv]``, segment ids
  ``[B, Tp]`` / ``[B, Sp]`` (or None), off int32 ``[]`` -> (``[B, Tp, H, Dv]``, the base-2
  log-sum-exp in the backend's layout: GPU ``[B, H, Tp]``, TPU ``[B, H, Tp, 1]``)."""
  return _forward(q, k, v, qseg, kseg, off, st)


def _attention_fwd(q, k, v, qseg, kseg, off, st: Static):
  o, lse = _forward(q, k, v, qseg, kseg, off, st)
  return (o, lse), (q, k, v, qseg, kseg, off, o, lse)


def _attention_bwd(st: Static, res, cts):
  q, k, v, qseg, kseg, off, o, lse = res
  do, dlse = cts
  if st.backend == "gpu":
    dq, dk, dv = _gpu_bwd(q, k, v, qseg, kseg, off, o, lse, do, dlse, st)
  else:
    dq, dk, dv = map(_to_tpu, prefill_tpu.backward(*map(_to_tpu, (q, k, v)), qseg, kseg, off,
                                                   _to_tpu(o), lse, _to_tpu(do), dlse, st))
  return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad_seq(x, n, mode="constant"):
  return x if x.shape[1] == n else jnp.pad(x, [(0, 0), (0, n - x.shape[1])] +
                                           [(0, 0)] * (x.ndim - 2), mode=mode)


def _setup(q, k, v, *, segment_ids, kv_segment_ids, q_offset, causal, scale, backend, blocks,
           interpret, name):
  """Checks one call's inputs; returns its static description and the padded query and key
  lengths, segment ids and the int32 query offset."""
  if backend not in ("gpu", "tpu"):
    raise ValueError(f"{name}: unknown Pallas backend {backend!r}; expected 'gpu' or 'tpu'")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"{name}: q, k, v must be [B, T, H, D]; got {q.shape}, {k.shape}, {v.shape}")
  b, t, h, dk = q.shape
  s, dv = k.shape[1], v.shape[-1]
  if k.shape != (b, s, h, dk) or v.shape[:3] != (b, s, h):
    raise ValueError(f"{name}: shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}")
  if dk % 16 or dv % 16:
    raise ValueError(f"{name}: head dims must be multiples of 16; got Dk={dk}, Dv={dv}")
  if kv_segment_ids is not None and segment_ids is None:
    raise ValueError(f"{name}: kv_segment_ids needs segment_ids (the queries' ids)")
  if segment_ids is not None and (segment_ids.shape != (b, t) or
                                  (kv_segment_ids is None and s != t)):
    raise ValueError(f"{name}: segment_ids must be [B, T] (with S == T unless kv_segment_ids is "
                     f"given); got {segment_ids.shape} for q {q.shape}, k {k.shape}")
  if kv_segment_ids is not None and kv_segment_ids.shape != (b, s):
    raise ValueError(f"{name}: kv_segment_ids must be [B, S] = {(b, s)}; got "
                     f"{kv_segment_ids.shape}")
  off = jnp.asarray(s - t if q_offset is None else q_offset)
  if off.ndim != 0 or not jnp.issubdtype(off.dtype, jnp.integer):
    raise ValueError(f"{name}: q_offset must be an integer scalar; got {off.dtype} {off.shape}")
  if interpret is None:
    interpret = default_backend() != backend
  blk = (blocks or (GPU_BLOCKS if backend == "gpu" else TPU_BLOCKS)).fitted(t, s)
  n = blk.pad_to()
  tp, sp = -(-t // n) * n, -(-s // n) * n
  static_off = None
  if q_offset is None or isinstance(q_offset, int):
    static_off = s - t if q_offset is None else q_offset
  st = Static(backend=backend, causal=bool(causal), scale=float(scale), t=t, s=s, blocks=blk,
               interpret=bool(interpret), static_off=static_off)
  qseg = kseg = None
  if segment_ids is not None:
    kv = segment_ids if kv_segment_ids is None else kv_segment_ids
    qseg = _pad_seq(segment_ids.astype(jnp.int32), tp, mode="edge")
    kseg = _pad_seq(kv.astype(jnp.int32), sp, mode="edge")
  return st, tp, sp, qseg, kseg, off.astype(jnp.int32)


def mla_attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, causal=True,
                  scale, backend, blocks=None, interpret=None, return_lse=False):
  """Flash attention over q ``[B, T, H, Dk]``, k ``[B, S, H, Dk]``, v ``[B, S, H, Dv]`` ->
  ``[B, T, H, Dv]`` (q's dtype); with ``return_lse`` also each row's log-sum-exp of its visible
  scaled scores ``[B, T, H]`` float32 (``-inf`` where it sees no key), differentiable.

  Query i may see key j iff (not causal or ``j <= q_offset + i``) and the segment ids agree;
  rows that see no key give zeros. q_offset: int or int32 scalar array (may be traced), the key
  position of query row 0; default ``S - T`` (the last query with the last key). segment_ids
  ``[B, T]``: the queries' ids; kv_segment_ids ``[B, S]``: the keys' (default segment_ids, which
  then needs S == T; only with segment_ids). ``backend``: "gpu" (Triton) or "tpu" (Mosaic);
  interpret mode by default off the matching platform. ``blocks`` overrides the tile sizes
  (``Blocks``). Gradients flow to q, k, v only."""
  st, tp, sp, qseg, kseg, off = _setup(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      causal=causal, scale=scale, backend=backend, blocks=blocks, interpret=interpret,
      name="mla_attention")
  t = q.shape[1]
  o, lse = _attention(_pad_seq(q, tp), _pad_seq(k, sp), _pad_seq(v, sp), qseg, kseg, off, st)
  if not return_lse:
    return o[:, :t]
  lse = (lse if backend == "gpu" else lse[..., 0])[:, :, :t].transpose(0, 2, 1)  # [B, T, H]
  return o[:, :t], jnp.where(lse == jnp.inf, -jnp.inf, lse / LOG2E)


def mla_attention_grad(q, k, v, o, lse, do, *, segment_ids=None, kv_segment_ids=None,
                       q_offset=None, causal=True, scale, backend, blocks=None, interpret=None):
  """The backward kernels alone, for keys that are one block of a larger set: ``(dq, dk, dv)``
  of attention over k, v when each query row's softmax is normalised by lse ``[B, T, H]``
  (natural log over the whole set, ``-inf`` where the row sees no key) and o ``[B, T, H, Dv]``
  is the output over the whole set, do its cotangent (the semantics of
  ``reference.attention_grad``). Arguments otherwise as :func:`mla_attention`'s."""
  st, tp, sp, qseg, kseg, off = _setup(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      causal=causal, scale=scale, backend=backend, blocks=blocks, interpret=interpret,
      name="mla_attention_grad")
  t, s = q.shape[1], k.shape[1]
  # the kernels' base-2 lse [B, H, Tp] (TPU: [..., 1]); +inf for rows that see nothing
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E).transpose(0, 2, 1)
  lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, tp - t)), constant_values=jnp.inf)
  if backend == "tpu":
    lse2 = lse2[..., None]
  res = (_pad_seq(q, tp), _pad_seq(k, sp), _pad_seq(v, sp), qseg, kseg, off, _pad_seq(o, tp), lse2)
  dq, dk, dv_, *_ = _attention_bwd(st, res, (_pad_seq(do.astype(q.dtype), tp),
                                             jnp.zeros_like(lse2)))
  return dq[:, :t], dk[:, :s], dv_[:, :s]


__all__ = ["mla_attention", "mla_attention_grad", "Blocks", "GPU_BLOCKS", "TPU_BLOCKS",
           "block_tables"]
