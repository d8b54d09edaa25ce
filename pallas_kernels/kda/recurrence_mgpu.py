"""The chunked KDA forward's sequential pass as a Mosaic GPU kernel (Hopper: TMA, wgmma, two
warpgroups).

Same inputs and results as ``recurrence._fwd_kernel`` (the Triton pass): per chunk of C = 64
tokens, ``V' = U - W S``, ``O = QG S + A_qk V'``, ``S <- gC * S + KD^T V'``. In Triton one
program issues all four products in order and waits for each, so the output's two products sit
on the chain that carries the state from chunk to chunk (most of the forward pass's cycles have
no warp ready to issue: benchmarks/RESULTS.md, KDA runs 23-26). Here one CTA per (value tile,
batch * value head) runs two warpgroups:

* warpgroup 0 carries the state ``S [K, BV]`` float32 in registers. Per chunk it writes S (bf16)
  to SMEM, forms ``V' = U - W S`` (wgmma), writes V' (bf16) to SMEM, hands both to warpgroup 1
  (``ready``) and updates ``S = gC * S + KD^T V'`` (wgmma onto the decayed state). With ``store``
  it also copies S and V' from SMEM to ``h`` and ``vn`` (TMA), the residuals of the backward.
* warpgroup 1 forms ``O = QG S + A_qk V'`` from the same SMEM tiles while warpgroup 0 moves on,
  releases them (``free``) and stores O (TMA).

``recurrence_bwd`` is the backward's pass (``recurrence._bwd_kernel``), one warpgroup per (value
tile, batch * value head), chunks in reverse: ``dV' = A_qk^T dO + KD dS`` and ``dS <- gC * dS +
QG^T dO - W^T dV'``, each as two wgmmas issued together (the one with dO first, off the chain)
and awaited once, where Triton awaits each of the four products.

Each warpgroup streams its own chunk tiles (W, KD, U, gC; QG, A_qk) through a ring of
``stages`` SMEM slots, ``stages - 1`` chunks ahead. S and V' (and O, dS, dV') are
double-buffered, so warpgroup 0 waits for warpgroup 1 only two chunks later, where two buffers
and two ring slots fit the SMEM; else (K = 128 with a 128-wide V tile: one CTA per (batch, head),
one wave for 128 of them) single-buffered, warpgroup 0 writing the next chunk's S once warpgroup
1 has read the last. Shapes: w, qg, kd ``[B, Tp, HV, K]``, u
``[B, Tp, HV, V]``, aqk ``[B, Tp, HV, C]`` (bf16), gc ``[B, NC, HV, K]`` and s0 ``[B, HV, K, V]``
float32; outputs o ``[B, Tp, HV, V]``, the final state ``[B, HV, K, V]`` float32, with
``store`` h ``[B, NC, HV, K, V]`` and vn ``[B, Tp, HV, V]`` (bf16), and with ``every`` the
states after every ``every`` chunks (float32, the prefix cache's checkpoints of serving:
warpgroup 0 stores them straight from its registers: no SMEM, and no wait on the state's chain).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kernel_output, wgmma

CHUNK = 64  # the wgmma row tile: the chunk of the dense path (of every Mosaic KDA kernel)


def supported(w, u, chunk: int, *stored) -> bool:
  """Whether the kernels take these factors: w and the value-side tile u (U or dO) in bf16,
  64-token chunks, K = 64 or 128 (two ring slots of K = 256 exceed the SMEM), V a multiple of
  16, and what they store (the dtypes ``stored``) in bf16."""
  bf16 = jnp.dtype(jnp.bfloat16)
  return (w.dtype == bf16 and u.dtype == bf16 and chunk == CHUNK and w.shape[-1] in (64, 128)
          and u.shape[-1] % 16 == 0 and all(jnp.dtype(d) == bf16 for d in stored))


def _slot_bytes(kdim: int, bv: int) -> int:
  """One ring slot: a chunk's tiles, the same in both passes (W, KD, QG, A_qk, gC and the
  [C, BV] tile U or dO)."""
  return 2 * (3 * CHUNK * kdim + CHUNK * bv + CHUNK * CHUNK) + 4 * kdim


def _other_bytes(kdim: int, bv: int, forward: bool, nbuf: int) -> int:
  """Besides the ring: the forward's ``nbuf`` buffers of S, V' and O, the backward's of dS and
  dV' and its -dV'."""
  if forward:
    return 2 * nbuf * (kdim * bv + 2 * CHUNK * bv)
  return 2 * (nbuf * (kdim * bv + CHUNK * bv) + CHUNK * bv)


def _ring_bytes(kdim: int, bv: int, forward: bool, nbuf: int) -> int:
  """The SMEM left for the ring beside ``nbuf`` buffers (and 1 KiB of barriers)."""
  return wgmma.SMEM_BYTES - 1024 - _other_bytes(kdim, bv, forward, nbuf)


def buffers(kdim: int, bv: int, forward: bool) -> int:
  """2 (double-buffered S, V', ...) where they fit beside two ring slots, else 1."""
  return 2 if _ring_bytes(kdim, bv, forward, 2) >= 2 * _slot_bytes(kdim, bv) else 1


def ring_slots(kdim: int, bv: int, want: int, forward: bool) -> int:
  """Ring slots of a pass: ``want``, or as many as fit the SMEM beside its :func:`buffers`
  (at least 2)."""
  room = _ring_bytes(kdim, bv, forward, buffers(kdim, bv, forward))
  return max(2, min(want, room // _slot_bytes(kdim, bv)))


def _ring(bars, stages: int, nc: int, tiles):
  """``fetch(i)``: TMA of the i-th chunk's tiles (``tiles``: (i -> GMEM ref, SMEM ring) pairs)
  into ring slot ``i % stages``, signalled on ``bars[slot]``; the first ``stages - 1`` chunks are
  fetched here."""
  def fetch(i):
    slot = lax.rem(jnp.int32(i), jnp.int32(stages))
    for src, ring in tiles:
      plgpu.copy_gmem_to_smem(src(i), ring.at[slot], bars.at[slot])

  for j in range(stages - 1):
    pl.when(j < nc)(functools.partial(fetch, j))
  return fetch


def _kernel(w_ref, u_ref, qg_ref, a_ref, kd_ref, gc_ref, s0_ref, o_ref, st_ref, *rest, hv, nc,
            bv, stages, nbuf, store, every, interpret):
  n_out = 2 * store + bool(every)
  outs, scratch = rest[:n_out], rest[n_out:]
  (w_smem, kd_smem, u_smem, gc_smem, qg_smem, a_smem, s_smem, vn_smem, o_smem,
   in0, in1, ready, free) = scratch
  c = CHUNK
  bh, wg = lax.axis_index("bh"), lax.axis_index("wg")
  # int32 operands of lax.div / lax.rem and int32 loop indices, also under jax_enable_x64
  b, h = lax.div(bh, jnp.int32(hv)), lax.rem(bh, jnp.int32(hv))
  vs = pl.ds(pl.multiple_of(lax.axis_index("v") * bv, bv), bv)
  rows = lambda i: pl.ds(i * c, c)

  @pl.when(wg == 0)
  def _state():
    fetch = _ring(in0, stages, nc, (
        (lambda i: w_ref.at[b, rows(i), h], w_smem), (lambda i: kd_ref.at[b, rows(i), h], kd_smem),
        (lambda i: u_ref.at[b, rows(i), h, vs], u_smem), (lambda i: gc_ref.at[b, i, h], gc_smem)))

    def step(i, s):
      slot, p = lax.rem(i, jnp.int32(stages)), lax.rem(i, jnp.int32(nbuf))
      pl.when(i + stages - 1 < nc)(lambda: fetch(i + stages - 1))
      plgpu.barrier_wait(in0.at[slot])
      pl.when(i >= nbuf)(lambda: plgpu.barrier_wait(free.at[p]))  # warpgroup 1 is done with p
      if store:
        plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)  # chunk i - nbuf's copies read p
      s_smem.at[p][...] = s.astype(s_smem.dtype)
      plgpu.commit_smem()
      vn = (plgpu.load(u_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            - wgmma.product((c, bv), (w_smem.at[slot], s_smem.at[p])))
      vn_smem.at[p][...] = vn.astype(vn_smem.dtype)
      plgpu.commit_smem()
      if store:
        plgpu.copy_smem_to_gmem(s_smem.at[p], outs[0].at[b, i, h, :, vs], commit_group=False)
        plgpu.copy_smem_to_gmem(vn_smem.at[p], outs[1].at[b, rows(i), h, vs],
                                commit_group=False)
        plgpu.commit_smem_to_gmem_group()
      plgpu.barrier_arrive(ready.at[p])
      decay = plgpu.load(gc_smem.at[slot], layout=wgmma.ROWS)
      s = s * lax.broadcast_in_dim(decay, s.shape, [0])
      s = wgmma.add(s, (kd_smem.at[slot].T, vn_smem.at[p]), interpret=interpret)
      if every:  # the state after every ``every`` chunks, float32, from the registers (a
        # TMA copy staged through SMEM waited on the chain: benchmarks/RESULTS.md, issue 40 run 18)
        m = lax.div(i + 1, jnp.int32(every))

        @pl.when(m * every == i + 1)
        def _():
          outs[-1].at[b, m - 1, h, :, vs][...] = s
      return s

    s0 = plgpu.load(s0_ref.at[b, h, :, vs], layout=plgpu.Layout.WGMMA, optimized=False)
    st_ref.at[b, h, :, vs][...] = lax.fori_loop(jnp.int32(0), nc, step, s0)
    for j in range(nbuf):  # warpgroup 1's releases of the last chunks (each phase waited once)
      pl.when(nc > j)(lambda: plgpu.barrier_wait(free.at[jnp.int32((nc - 1 - j) % nbuf)]))
    if store:
      plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _output():
    fetch = _ring(in1, stages, nc, ((lambda i: qg_ref.at[b, rows(i), h], qg_smem),
                                    (lambda i: a_ref.at[b, rows(i), h], a_smem)))

    def step(i, carry):
      slot, p = lax.rem(i, jnp.int32(stages)), lax.rem(i, jnp.int32(nbuf))
      pl.when(i + stages - 1 < nc)(lambda: fetch(i + stages - 1))
      plgpu.barrier_wait(in1.at[slot])
      plgpu.barrier_wait(ready.at[p])
      o = wgmma.product((c, bv), (qg_smem.at[slot], s_smem.at[p]), (a_smem.at[slot], vn_smem.at[p]))
      plgpu.barrier_arrive(free.at[p])
      plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)  # chunk i - nbuf's store read it
      o_smem.at[p][...] = o.astype(o_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[p], o_ref.at[b, rows(i), h, vs])
      return carry

    lax.fori_loop(jnp.int32(0), nc, step, 0)
    plgpu.wait_smem_to_gmem(0)


def recurrence_fwd(w, u, qg, aqk, kd, gc, s0, *, out_dtype, store: bool, block_v: int,
                   stages: int, interpret: bool, every: int = 0):
  """(o, final state), with ``store`` (h, vn) and with ``every`` last the states after every
  ``every`` chunks ``[B, max(NC // every, 1), HV, K, V]`` float32; see the module docstring."""
  bsz, tp, hv, kdim = w.shape
  vd = u.shape[-1]
  c, nc = CHUNK, tp // CHUNK
  bv = block_v
  stages = ring_slots(kdim, bv, stages, forward=True)
  nbuf = buffers(kdim, bv, forward=True)
  bf16 = jnp.bfloat16
  out_type = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), out_dtype),
              jax.ShapeDtypeStruct((bsz, hv, kdim, vd), jnp.float32)]
  if store:
    out_type += [jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), bf16),
                 jax.ShapeDtypeStruct((bsz, tp, hv, vd), bf16)]
  if every:
    out_type.append(jax.ShapeDtypeStruct((bsz, max(nc // every, 1), hv, kdim, vd), jnp.float32))
  kern = functools.partial(_kernel, hv=hv, nc=nc, bv=bv, stages=stages, nbuf=nbuf, store=store,
                           every=every, interpret=interpret)
  kern.__name__ = "kda_fwd_recurrence_mgpu"
  # the key-side tiles meet the BV-wide S and V' in their products: the swizzle of a BV row
  key = functools.partial(wgmma.swizzled, dtype=bf16, swizzle=min(2 * bv, 128))
  scratch = (
      key((stages, c, kdim)),  # W
      key((stages, c, kdim)),  # KD
      wgmma.swizzled((stages, c, bv), bf16),  # U
      plgpu.SMEM((stages, kdim), jnp.float32),  # gC
      key((stages, c, kdim)),  # QG
      key((stages, c, c)),  # A_qk
      wgmma.swizzled((nbuf, kdim, bv), bf16),  # S entering the chunk
      wgmma.swizzled((nbuf, c, bv), bf16),  # V'
      wgmma.swizzled((nbuf, c, bv), out_dtype),  # O
      plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # warpgroup 0's tiles landed
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # warpgroup 1's tiles landed
      plgpu.Barrier(num_barriers=nbuf),  # S, V' of a chunk written (warpgroup 0 -> 1)
      plgpu.Barrier(num_barriers=nbuf),  # ... and read (warpgroup 1 -> 0)
  )
  outs = plgpu.kernel(
      kern, out_type=tuple(out_type), scratch_types=scratch, grid=(vd // bv, bsz * hv),
      grid_names=("v", "bh"), **wgmma.kernel_params(interpret, threads=2))(
          w, u, qg, aqk, kd, gc, s0)
  return tuple(kernel_output(x) for x in outs)


def _bwd_kernel(do_ref, qg_ref, a_ref, kd_ref, w_ref, gc_ref, dst_ref, dvn_ref, dh_ref, ds0_ref,
                do_smem, a_smem, kd_smem, qg_smem, w_smem, gc_smem, ds_smem, dvn_smem, ndvn_smem,
                ready, *, hv, nc, bv, stages, nbuf, interpret):
  c = CHUNK
  bh = lax.axis_index("bh")
  b, h = lax.div(bh, jnp.int32(hv)), lax.rem(bh, jnp.int32(hv))
  vs = pl.ds(pl.multiple_of(lax.axis_index("v") * bv, bv), bv)

  rows = lambda j: pl.ds((nc - 1 - j) * c, c)  # the j-th chunk of the reverse walk
  tile = lambda ref: (lambda j: ref.at[b, rows(j), h])
  fetch = _ring(ready, stages, nc, (
      (lambda j: do_ref.at[b, rows(j), h, vs], do_smem), (tile(a_ref), a_smem),
      (tile(kd_ref), kd_smem), (tile(qg_ref), qg_smem), (tile(w_ref), w_smem),
      (lambda j: gc_ref.at[b, nc - 1 - j, h], gc_smem)))

  def step(j, ds):
    slot, p, ci = lax.rem(j, jnp.int32(stages)), lax.rem(j, jnp.int32(nbuf)), nc - 1 - j
    pl.when(j + stages - 1 < nc)(lambda: fetch(j + stages - 1))
    plgpu.barrier_wait(ready.at[slot])
    plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)  # chunk j - nbuf's copies read p
    ds_smem.at[p][...] = ds.astype(ds_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ds_smem.at[p], dh_ref.at[b, ci, h, :, vs], commit_group=False)
    dvn = wgmma.product((c, bv), (a_smem.at[slot].T, do_smem.at[slot]),
                        (kd_smem.at[slot], ds_smem.at[p]))
    dvn_smem.at[p][...] = dvn.astype(dvn_smem.dtype)
    ndvn_smem[...] = (-dvn).astype(ndvn_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dvn_smem.at[p], dvn_ref.at[b, rows(j), h, vs],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    decay = plgpu.load(gc_smem.at[slot], layout=wgmma.ROWS)
    return wgmma.add(ds * lax.broadcast_in_dim(decay, ds.shape, [0]),
                     (qg_smem.at[slot].T, do_smem.at[slot]), (w_smem.at[slot].T, ndvn_smem),
                     interpret=interpret)

  dst = plgpu.load(dst_ref.at[b, h, :, vs], layout=plgpu.Layout.WGMMA, optimized=False)
  ds0_ref.at[b, h, :, vs][...] = lax.fori_loop(jnp.int32(0), nc, step, dst)
  plgpu.wait_smem_to_gmem(0)


def recurrence_bwd(do, qg, aqk, kd, w, gc, dst, *, block_v: int, stages: int, interpret: bool):
  """(dvn ``[B, Tp, HV, V]``, dh ``[B, NC, HV, K, V]`` (bf16), ds0 ``[B, HV, K, V]`` float32):
  the gradients of V', of the state leaving each chunk and of the initial state, from dO
  ``[B, Tp, HV, V]`` (bf16), the forward's factors and the final state's gradient ``dst``."""
  bsz, tp, hv, kdim = w.shape
  vd = do.shape[-1]
  c, nc, bv = CHUNK, tp // CHUNK, block_v
  stages = ring_slots(kdim, bv, stages, forward=False)
  nbuf = buffers(kdim, bv, forward=False)
  bf16 = jnp.bfloat16
  key = functools.partial(wgmma.swizzled, dtype=bf16, swizzle=min(2 * bv, 128))
  kern = functools.partial(_bwd_kernel, hv=hv, nc=nc, bv=bv, stages=stages, nbuf=nbuf,
                           interpret=interpret)
  kern.__name__ = "kda_bwd_recurrence_mgpu"
  outs = plgpu.kernel(
      kern,
      out_type=(jax.ShapeDtypeStruct((bsz, tp, hv, vd), bf16),
                jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), bf16),
                jax.ShapeDtypeStruct((bsz, hv, kdim, vd), jnp.float32)),
      scratch_types=(
          wgmma.swizzled((stages, c, bv), bf16),  # dO
          key((stages, c, c)),  # A_qk
          key((stages, c, kdim)),  # KD
          key((stages, c, kdim)),  # QG
          key((stages, c, kdim)),  # W
          plgpu.SMEM((stages, kdim), jnp.float32),  # gC
          wgmma.swizzled((nbuf, kdim, bv), bf16),  # dS leaving the chunk
          wgmma.swizzled((nbuf, c, bv), bf16),  # dV'
          wgmma.swizzled((c, bv), bf16),  # -dV'
          plgpu.Barrier(num_arrivals=6, num_barriers=stages)),  # a chunk's tiles landed
      grid=(vd // bv, bsz * hv), grid_names=("v", "bh"), **wgmma.kernel_params(interpret))(
          do, qg, aqk, kd, w, gc, dst)
  return tuple(kernel_output(x) for x in outs)
